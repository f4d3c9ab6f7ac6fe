//! `outbox`: migrate the schema, enqueue, run the relay, inspect and pause the outbox, and
//! a self-contained demo. Flags override `OUTBOX_*` environment variables, which override
//! an optional `outbox.toml` (keys are the long flag names, e.g. `database-url = "…"`).
//!
//! This file parses the command line and dispatches: each command lives in its module
//! under `cmd/`, what they share in `shared` and `text`, process setup in `setup`.

mod cmd;
mod config;
mod dashboard;
mod demo;
mod otlp;
mod serve;
mod setup;
mod shared;
mod text;

/// The process's allocator: mimalloc rather than the C library's. The relay allocates per
/// message (decoded rows, headers, the broker client's buffers); with glibc's allocator
/// malloc and free were about a fifth of the relay's instructions per message.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};
use shared::{GlobalArgs, USAGE, error_chain};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "outbox",
    version,
    about = "Transactional outbox: enqueue in your transaction, relay at least once.",
    after_help = "Exit codes: 0 success; 1 an error (a database or sink that cannot be reached or \
opened, refused rows, a failed `status --check`); 2 a usage error (bad flags, a bad \
configuration or sink URL, a relay without a sink); `relay --drain`: 3 some publishes failed and were \
rescheduled, 4 none failed but some messages were quarantined."
)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,

    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the relay's variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Create or upgrade the outbox schema (idempotent).
    Migrate(cmd::migrate::Args),
    /// Enqueue one message in its own transaction (payload from stdin when --payload is absent).
    Enqueue(cmd::enqueue::Args),
    /// Run the relay: claim due messages, publish, mark after confirmation.
    Relay(cmd::relay::Args),
    /// Serve the admin dashboard: the page at /, a JSON API under /api/ (status, dead
    /// letters, replay, discard, the audit, pauses, message search), /metrics, /healthz
    /// and /readyz. Every request but the page and the probes needs a bearer token
    /// (OUTBOX_ADMIN_TOKEN, OUTBOX_ADMIN_READ_TOKEN or --admin-tokens-file); without one it
    /// listens on loopback only.
    Serve(cmd::serve::Args),
    /// Show counts by status, due and expired claims, live relays, pauses and a verdict
    /// (OK, STUCK, BLOCKED, BEHIND, DEAD, PAUSED).
    Status(cmd::status::Args),
    /// Stop relays from publishing: every topic, or (with --topic) only matching topics
    /// while the others flow. Producers keep writing.
    Pause(cmd::pause::Args),
    /// Let relays publish again (with --topic: lift that topic pause).
    Resume(cmd::resume::Args),
    /// Dead letters: list, show, discard.
    #[command(subcommand)]
    Dead(cmd::dead::DeadCommand),
    /// Move dead letters back to pending (same message id, attempts reset), audited.
    Replay(cmd::replay::Args),
    /// The audit of replays, discards, dead-row purges, pauses and resumes.
    #[command(subcommand)]
    Replays(cmd::replays::ReplaysCommand),
    /// Delete dispatched rows older than the retention, in bounded batches (pending,
    /// claimed and dead rows are never touched). Prints `{"deleted":N,"locked_out":BOOL}`;
    /// when another purge is running it stops, says so on stderr and exits 0. With
    /// --dead-older-than, deletes dead rows older than that instead (audited).
    Purge(cmd::purge::Args),
    /// The consumer inbox (deduplication rows written by `inbox_accept`).
    #[command(subcommand)]
    Inbox(cmd::inbox::InboxCommand),
    /// A self-contained run on SQLite in a temporary directory (the global options do not
    /// apply: the demo makes its own databases).
    Demo {
        /// Orders to place: at least 200, so that relay 1 reaches its third batch of 50
        /// (where it crashes).
        #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u32).range(200..))]
        orders: u32,
    },
}

/// The command line, parsed with every environment value hidden from `--help` (URLs,
/// routes and tokens come from there). A usage error is printed with every URL it quotes
/// redacted ([`redact_urls_in`]); `--help` and `--version` as clap prints them. The exit
/// code is clap's: 2 for a usage error, 0 for `--help` and `--version`.
fn parse_args() -> Result<Cli, ExitCode> {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let mut command = hide_env_values(Cli::command());
    command
        .try_get_matches_from_mut(std::env::args_os())
        .and_then(|m| Cli::from_arg_matches(&m))
        .map_err(|mut e| {
            usage_without_env(&command, std::env::args_os(), &mut e);
            if e.use_stderr() {
                eprint!("{}", redact_urls_in(&e.render().to_string()));
            } else {
                // --help and --version: text of the program's own, environment values
                // hidden.
                let _ = e.print();
            }
            ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(USAGE))
        })
}

/// Replaces the usage line of `e` (an error parsing `args`) by the command's own when an
/// option's value came from its environment variable: clap's line lists every option
/// given, so `--database-url <DATABASE_URL>` would look required when it came from
/// `OUTBOX_DATABASE_URL`.
fn usage_without_env(
    command: &clap::Command,
    args: impl IntoIterator<Item = std::ffi::OsString>,
    e: &mut clap::Error,
) {
    use clap::error::{ContextKind, ContextValue};
    if e.get(ContextKind::Usage).is_none() {
        return;
    }
    fn lenient(c: clap::Command) -> clap::Command {
        c.ignore_errors(true).mut_subcommands(lenient)
    }
    let Ok(matches) = lenient(command.clone()).try_get_matches_from(args) else {
        return;
    };
    let from_env = |cmd: &clap::Command, m: &clap::ArgMatches| {
        cmd.get_arguments().any(|a| {
            m.try_contains_id(a.get_id().as_str()).unwrap_or(false)
                && m.value_source(a.get_id().as_str())
                    == Some(clap::parser::ValueSource::EnvVariable)
        })
    };
    let mut any_env = from_env(command, &matches);
    let mut cmd = command;
    let mut m = &matches;
    while let Some((name, sub_matches)) = m.subcommand() {
        let Some(sub) = cmd.find_subcommand(name) else {
            break;
        };
        cmd = sub;
        m = sub_matches;
        any_env |= from_env(cmd, m);
    }
    if any_env {
        e.insert(
            ContextKind::Usage,
            ContextValue::StyledStr(cmd.clone().render_usage()),
        );
    }
}

/// `command` with every argument's environment value hidden from the help text, its
/// subcommands' too.
fn hide_env_values(command: clap::Command) -> clap::Command {
    command
        .mut_args(|a| a.hide_env_values(true))
        .mut_subcommands(hide_env_values)
}

/// `text` (clap's rendered error) with every word that looks like a URL or carries a user
/// (`://` or `@` in it) redacted by [`outbox::redact::redact_unknown_url`]; an option
/// prefix (`--sink=`, a route's `pattern=`) is kept before the URL.
fn redact_urls_in(text: &str) -> String {
    let is_break = |c: char| c.is_whitespace() || matches!(c, '\'' | '"' | '`' | '[' | ']');
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.contains("://") || word.contains('@') {
            let url_at = word.find("://").unwrap_or(word.len());
            let (prefix, url) = match word[..url_at].rfind('=') {
                Some(eq) => word.split_at(eq + 1),
                None => ("", word.as_str()),
            };
            out.push_str(prefix);
            out.push_str(&outbox::redact::redact_unknown_url(url));
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in text.chars() {
        if is_break(c) {
            flush(&mut word, &mut out);
            out.push(c);
        } else {
            word.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

fn main() -> ExitCode {
    // Before any thread exists: outbox.toml values become OUTBOX_* defaults.
    if let Err(e) = config::apply_config_file(&<Cli as clap::CommandFactory>::command()) {
        eprintln!("error: {e:#}");
        return ExitCode::from(USAGE);
    }
    let cli = match parse_args() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    // Before the runtime: the exporter's HTTP client is a blocking one.
    let tracer = match &cli.command {
        Command::Relay(cmd::relay::Args {
            otlp_endpoint: Some(url),
            ..
        }) if !url.is_empty() => match otlp::provider(url) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("error: {}", error_chain(&e));
                return ExitCode::from(USAGE);
            }
        },
        _ => None,
    };
    setup::init_logs(tracer.as_ref());
    setup::raise_open_files_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The command runs as a task on the runtime's worker threads, not on this thread:
    // polled here, every wake-up from the I/O the workers drive (the database's and the
    // broker's sockets) crossed threads (measured: a drain of 50,000 rows made 4,157
    // futex calls this way against 629 for a bare relay, and 1.7 x its CPU).
    let command = runtime.spawn(run(cli));
    let code = match runtime.block_on(async {
        match command.await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(anyhow::anyhow!("the command's task ended: {e}")),
        }
    }) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            if is_configuration_error(&e) {
                ExitCode::from(USAGE)
            } else {
                ExitCode::FAILURE
            }
        }
    };
    drop(runtime);
    if let Some(p) = &tracer {
        otlp::shutdown(p);
    }
    code
}

/// A sink URL or route the library refuses as written (an unknown scheme, a malformed URL
/// or pattern: [`outbox::sink::SinkError::InvalidUrl`]) is a configuration error, exit 2
/// as a bad flag; a sink that cannot be reached or opened stays exit 1.
fn is_configuration_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<outbox::sink::SinkError>(),
            Some(outbox::sink::SinkError::InvalidUrl { .. })
        )
    })
}

/// Runs the command: each in its module.
async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let global = &cli.global;
    match &cli.command {
        Command::Demo { orders } => demo::run(*orders).await,
        Command::Migrate(args) => cmd::migrate::run(global, args).await,
        Command::Enqueue(args) => cmd::enqueue::run(global, args).await,
        Command::Relay(args) => cmd::relay::run(global, args).await,
        Command::Serve(args) => cmd::serve::run(global, args).await,
        Command::Status(args) => cmd::status::run(global, args).await,
        Command::Pause(args) => cmd::pause::run(global, args).await,
        Command::Dead(command) => cmd::dead::run(global, command).await,
        Command::Replay(args) => cmd::replay::run(global, args).await,
        Command::Replays(command) => cmd::replays::run(global, command).await,
        Command::Purge(args) => cmd::purge::run(global, args).await,
        Command::Inbox(command) => cmd::inbox::run(global, command).await,
        Command::Resume(args) => cmd::resume::run(global, args).await,
    }
}

#[cfg(test)]
mod tests {
    /// Every URL a usage error quotes loses its secrets; the words around it stay.
    #[test]
    fn usage_errors_are_redacted_word_by_word() {
        let text = "error: unexpected argument 'nats://u:SEKRIT@h' found\n  tip: '--sink=nats://TOKSEKRIT@h:4222' or \"a.>=amqp://g:SEKRIT@h/v\" or https://hooks.example/services/T/B/SEKRIT\n";
        let out = super::redact_urls_in(text);
        assert!(!out.contains("SEKRIT"), "{out}");
        assert!(
            out.starts_with("error: unexpected argument 'nats://"),
            "{out}"
        );
        assert!(out.contains("'--sink=nats://***@h:4222'"), "{out}");
        assert!(out.contains("\"a.>=amqp://"), "{out}");
        assert!(out.contains("https://hooks.example/…#"), "{out}");
        assert!(out.contains("@h' found\n  tip: '--sink="), "{out}");
    }

    #[test]
    fn a_bad_route_never_shows_its_password() {
        use clap::Parser as _;
        for route in [
            "nats://u:TOPSECRET@127.0.0.1:4222",
            "nats://u:TOPSECRET@127.0.0.1:4222?ca=/x",
            "a..b=nats://u:TOPSECRET@127.0.0.1:4222",
            // No pattern, and a NATS token as the user name.
            "nats://TOPSECRET@127.0.0.1:4222",
            "nats://TOPSECRET@127.0.0.1:4222?x=1",
            "tls:/TOPSECRET@127.0.0.1:4222",
        ] {
            let Err(e) = super::Cli::try_parse_from(["outbox", "relay", "--route", route]) else {
                panic!("{route} was accepted");
            };
            let text = e.to_string();
            assert!(!text.contains("TOPSECRET"), "{text}");
            assert!(text.contains("route"), "{text}");
        }
    }
}
