//! What the commands share: the global options and opening the store, the exit codes,
//! printing to stdout, asking on the terminal, durations, and the shutdown signal.

use anyhow::Context as _;
use outbox::store::prelude::*;
use outbox::{AnyStore, Ident, StoreConfig};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Exit code of a usage error: bad flags, a bad configuration, a refused option value
/// (clap's own code for the same). 0 is success; 1 an error, a failed `status --check`
/// or refused rows.
pub(crate) const USAGE: u8 = 2;

/// Exit code of `relay --drain` when some publishes failed and were rescheduled (they
/// are still pending).
pub(crate) const DRAIN_RETRIED: u8 = 3;

/// Exit code of `relay --drain` when every publish succeeded or was settled but some
/// messages were quarantined as dead letters during the drain (permanent errors or
/// malformed rows): they will not be delivered without `outbox replay`. Exit 3 wins when
/// both happened.
pub(crate) const DRAIN_QUARANTINED: u8 = 4;

/// More rows than this need `--limit` or `--yes` (a prompt on a terminal).
pub(crate) const CONFIRM_ABOVE: u64 = 1_000;

/// The options every command takes (given before or after the command's name): where
/// the outbox is.
#[derive(clap::Args, Debug)]
pub(crate) struct GlobalArgs {
    /// Database URL: postgres://…, mysql://… (or mariadb://…), or sqlite://PATH (the file is
    /// created by `outbox migrate`).
    #[arg(
        long,
        env = "OUTBOX_DATABASE_URL",
        default_value = "sqlite://outbox.db",
        global = true,
        help_heading = "Global options"
    )]
    pub(crate) database_url: String,

    /// A file whose first line is the database password (the convention container
    /// platforms use for secrets): it replaces the password of --database-url, which then
    /// needs none.
    #[arg(
        long,
        env = "OUTBOX_DATABASE_PASSWORD_FILE",
        global = true,
        help_heading = "Global options"
    )]
    pub(crate) database_password_file: Option<std::path::PathBuf>,

    /// PostgreSQL schema (or MySQL/SQLite table prefix) holding the outbox tables.
    #[arg(
        long,
        env = "OUTBOX_SCHEMA",
        default_value = "outbox",
        global = true,
        help_heading = "Global options"
    )]
    pub(crate) schema: String,

    /// Largest message accepted at enqueue: payload + topic + key + headers, in bytes.
    /// `migrate` stores it for the SQL entry points (PostgreSQL, MySQL); without the flag
    /// the stored value is kept and used (4 MiB when none is stored).
    #[arg(
        long,
        env = "OUTBOX_MAX_MESSAGE_BYTES",
        global = true,
        help_heading = "Global options"
    )]
    pub(crate) max_message_bytes: Option<usize>,

    /// Config file (TOML; each key is an option's [env: OUTBOX_…] name without OUTBOX_, in
    /// lower case with dashes, e.g. database-url). Default: ./outbox.toml when present.
    #[arg(
        long,
        env = "OUTBOX_CONFIG",
        global = true,
        help_heading = "Global options"
    )]
    pub(crate) config: Option<std::path::PathBuf>,
}

/// How a command prints what it read: lines for people, or JSON (`--json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// Lines for people.
    Text,
    /// JSON: one object, or one per line for lists.
    Json,
}

impl Format {
    /// [`Format::Json`] when `json` (the `--json` flag), else [`Format::Text`].
    pub(crate) fn json_if(json: bool) -> Self {
        if json { Format::Json } else { Format::Text }
    }
}

/// What [`connect`] does when the SQLite file of `--database-url` does not exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Missing {
    /// Create it (`outbox migrate`).
    Create,
    /// Refuse, naming `outbox migrate`.
    Refuse,
}

/// Opens the store the global options name. A missing SQLite file is created with
/// [`Missing::Create`] (migrate only); every other command refuses it
/// ([`Missing::Refuse`]), rather than leave an empty one behind.
///
/// # Errors
/// A missing SQLite file (with [`Missing::Refuse`]), an unreadable password file, a bad
/// schema name, a store that cannot be opened.
pub(crate) async fn connect(cli: &GlobalArgs, missing: Missing) -> anyhow::Result<AnyStore> {
    let url = &match &cli.database_password_file {
        Some(file) => with_password_file(&cli.database_url, file)?,
        None => cli.database_url.clone(),
    };
    if missing == Missing::Refuse
        && let Some(path) = sqlite_path(url)
    {
        anyhow::ensure!(
            std::path::Path::new(path).exists(),
            "no outbox database at {path}: run `outbox migrate` (with the same --database-url or OUTBOX_DATABASE_URL) first"
        );
    }
    let config = |limit| -> anyhow::Result<StoreConfig> {
        Ok(StoreConfig {
            schema: Ident::new(&cli.schema)?,
            max_message_bytes: limit,
        })
    };
    let open = async |limit| {
        AnyStore::connect(url, config(limit)?)
            .await
            .with_context(|| {
                format!(
                    "cannot open the store at {}",
                    outbox::redact::redact_url(url)
                )
            })
    };
    let default = outbox::store::DEFAULT_MAX_MESSAGE_BYTES;
    let store = open(cli.max_message_bytes.unwrap_or(default)).await?;
    if cli.max_message_bytes.is_some() {
        return Ok(store);
    }
    // No flag: the limit stored by an earlier `migrate --max-message-bytes` holds.
    let stored = match &store {
        AnyStore::Postgres(pg) => pg.sql_enqueue_limit().await?,
        AnyStore::MySql(my) => my.sql_enqueue_limit().await?,
        _ => None,
    };
    match stored {
        Some(limit) if limit != default => open(limit).await,
        _ => Ok(store),
    }
}

/// Opens the store (refusing a missing SQLite file) and checks that its schema is
/// migrated: what every command but `migrate`, `relay` and `serve` starts with.
///
/// # Errors
/// As [`connect`]; a schema that is missing or of another version.
pub(crate) async fn open_checked(cli: &GlobalArgs) -> anyhow::Result<AnyStore> {
    let store = connect(cli, Missing::Refuse).await?;
    store.check_schema().await?;
    Ok(store)
}

/// `url` with its password replaced by the first line of `file`.
pub(crate) fn with_password_file(url: &str, file: &std::path::Path) -> anyhow::Result<String> {
    let password = outbox::sink::tls::read_secret("password", file)?;
    let mut parsed = url::Url::parse(url)
        .with_context(|| format!("{} is not a URL", outbox::redact::redact_url(url)))?;
    outbox::sink::tls::set_password(&mut parsed, &password).map_err(|()| {
        anyhow::anyhow!(
            "{} cannot carry a password",
            outbox::redact::redact_url(url)
        )
    })?;
    Ok(parsed.to_string())
}

/// The file of a `sqlite:` URL.
pub(crate) fn sqlite_path(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("sqlite:")?;
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    Some(rest.split('?').next().unwrap_or(rest))
}

/// Prints a line to stdout; a closed pipe (`outbox status | head -1`) ends quietly.
pub(crate) fn out(line: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "{line}")
        .and_then(|()| stdout.flush())
        .is_err()
    {
        std::process::exit(0);
    }
}

/// The error and its causes, each once (many errors repeat their source's text).
pub(crate) fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if !text.contains(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
    }
    text
}

/// A duration like `90s`, `15m`, `2h`, `7d` (humantime syntax, `1h30m` too).
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("{s:?} is not a duration: {e}"))
}

/// A duration as humans write it (`30days`, `1h 30m`).
pub(crate) fn humantime_fmt(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Asks on the terminal; false without one (a script must say --yes or --limit).
pub(crate) fn confirm(question: &str) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        return Ok(false);
    }
    eprint!("{question}");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// Cancels on SIGTERM or SIGINT (Ctrl-C).
pub(crate) async fn shutdown_on_signal(cancel: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut term) = signal(SignalKind::terminate()) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    tracing::info!(
        "shutdown requested: finishing in-flight messages (signal again to exit at once)"
    );
    cancel.cancel();
    // A second signal: exit now; claims still held come back after their lease.
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            eprintln!(
                "second signal: exiting without waiting; held claims return after their lease"
            );
            std::process::exit(130);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_password_file_is_taken_literally() {
        // `%` is part of the password: the store's and the sinks' clients percent-decode
        // the URL's password.
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("pw");
        std::fs::write(&file, "p%41ss:w@rd/%\n").unwrap_or_else(|e| panic!("{e}"));
        let url = super::with_password_file("postgres://app@db/shop", &file)
            .unwrap_or_else(|e| panic!("{e}"));
        let parsed = url::Url::parse(&url).unwrap_or_else(|e| panic!("{e}"));
        let decoded = percent_encoding::percent_decode_str(parsed.password().unwrap_or(""))
            .decode_utf8_lossy()
            .into_owned();
        assert_eq!(decoded, "p%41ss:w@rd/%", "{url}");
    }
}
