//! `outbox.toml`: optional defaults below environment variables and flags.
//!
//! Each key is an option's environment variable without `OUTBOX_`, lower-case, `_` as `-`
//! (`OUTBOX_DATABASE_URL` → `database-url`; usually the long flag name); its value becomes
//! that variable unless it is already set. Flags still override both.

use anyhow::Context as _;
use std::path::PathBuf;

/// Reads the config file named by `--config PATH`, `OUTBOX_CONFIG`, or `./outbox.toml`
/// when it exists, and exports its keys as `OUTBOX_*` defaults. Must run before any other
/// thread starts.
pub(crate) fn apply_config_file(command: &clap::Command) -> anyhow::Result<()> {
    // An earlier name set in the environment counts as the new one set there, so it still
    // comes before the file.
    for (old, new, convert) in RENAMED {
        if std::env::var_os(new).is_none()
            && let Ok(value) = std::env::var(old)
        {
            // SAFETY: called from `main` before the runtime or any other thread starts.
            unsafe { std::env::set_var(new, convert(&value)) };
        }
    }
    let args: Vec<String> = std::env::args().collect();
    let explicit = args
        .iter()
        .position(|a| a == "--config")
        .and_then(|i| args.get(i + 1).cloned())
        .or_else(|| {
            args.iter()
                .find_map(|a| a.strip_prefix("--config=").map(str::to_owned))
        })
        .or_else(|| std::env::var("OUTBOX_CONFIG").ok());
    let path = match explicit {
        Some(p) => PathBuf::from(p),
        None => {
            let default = PathBuf::from("outbox.toml");
            if !default.exists() {
                return Ok(());
            }
            default
        }
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        anyhow::anyhow!(
            "config file {} is not valid TOML: {}",
            path.display(),
            toml_error(&text, &e)
        )
    })?;
    let known = env_vars(command);
    for (key, value) in table {
        let mut var = format!("OUTBOX_{}", key.to_ascii_uppercase().replace('-', "_"));
        let renamed = RENAMED.iter().find(|(old, _, _)| *old == var);
        if let Some((_, new, _)) = renamed {
            var = (*new).to_owned();
        }
        if !known.contains(&var) {
            let mut keys: Vec<String> = known
                .iter()
                .map(|v| {
                    v.trim_start_matches("OUTBOX_")
                        .to_ascii_lowercase()
                        .replace('_', "-")
                })
                .collect();
            keys.sort();
            anyhow::bail!(
                "config file {}: unknown key {key:?}; known keys: {}",
                path.display(),
                keys.join(", ")
            );
        }
        let value = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Float(f) => f.to_string(),
            // A list (e.g. `route = ["orders.*=amqp://…", "audit.>=redis://…"]`) becomes the
            // space-separated form the flag's environment variable takes.
            toml::Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    toml::Value::String(s) => Ok(s.clone()),
                    other => Err(anyhow::anyhow!(
                        "config file {}: key {key:?} must list strings, got a {}",
                        path.display(),
                        other.type_str()
                    )),
                })
                .collect::<anyhow::Result<Vec<_>>>()?
                .join(" "),
            other => anyhow::bail!(
                "config file {}: key {key:?} must be a string, number or boolean, got a {}",
                path.display(),
                other.type_str()
            ),
        };
        let value = match renamed {
            Some((_, _, convert)) => convert(&value),
            None => value,
        };
        if std::env::var_os(&var).is_none() {
            // SAFETY: called from `main` before the runtime or any other thread starts.
            unsafe { std::env::set_var(&var, value) };
        }
    }
    Ok(())
}

/// Variables (and so `outbox.toml` keys) an option had before it was renamed: (earlier
/// name, name now, the earlier value in the new form). Both names are read; the new one
/// comes first.
const RENAMED: [(&str, &str, Convert); 1] = [
    // `purge --older-than-s SECONDS` became `--older-than DURATION`.
    ("OUTBOX_RETENTION_S", "OUTBOX_RETENTION", seconds),
];

/// An earlier value in the form its new name takes.
type Convert = fn(&str) -> String;

/// A number of seconds (`604800`) as a duration (`604800s`); anything else as it is, for
/// the option's own error.
fn seconds(value: &str) -> String {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        format!("{value}s")
    } else {
        value.to_owned()
    }
}

/// Where and why `text` is not TOML: line and column, the key of that line when it has a
/// plain one, and the parser's reason; never the line's text (the toml crate's own message
/// quotes it, and the line may hold a password).
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return e.message().to_owned();
    };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    let line_text = text[line_start..].lines().next().unwrap_or_default();
    let key = line_text
        .split_once('=')
        .map(|(k, _)| k.trim())
        .filter(|k| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        });
    let mut out = format!("line {line}, column {column}");
    if let Some(key) = key {
        out.push_str(&format!(" (key {key:?})"));
    }
    out.push_str(": ");
    out.push_str(e.message().trim());
    out
}

/// Every `OUTBOX_*` variable a flag of `command` (or its subcommands) reads.
fn env_vars(command: &clap::Command) -> std::collections::BTreeSet<String> {
    let mut out: std::collections::BTreeSet<String> = command
        .get_arguments()
        .filter_map(|a| a.get_env())
        .filter_map(|e| e.to_str().map(str::to_owned))
        .filter(|e| e.starts_with("OUTBOX_") && e != "OUTBOX_CONFIG")
        .collect();
    for sub in command.get_subcommands() {
        out.extend(env_vars(sub));
    }
    out
}
