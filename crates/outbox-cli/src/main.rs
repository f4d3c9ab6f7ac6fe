//! `outbox`: migrate the schema, enqueue, run the relay, inspect and pause the outbox, and
//! a self-contained demo. Flags override `OUTBOX_*` environment variables, which override
//! an optional `outbox.toml` (keys are the long flag names, e.g. `database-url = "…"`).

mod admin;
mod config;
mod dashboard;
mod demo;
mod otlp;
mod serve;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use outbox::store::prelude::*;
use outbox::{AnyStore, Ident, Message, Relay, RelayConfig, StoreConfig};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(
    name = "outbox",
    version,
    about = "Transactional outbox: enqueue in your transaction, relay at least once."
)]
struct Cli {
    /// Database URL: postgres://…, mysql://… (or mariadb://…), or sqlite://PATH (the file is
    /// created by `outbox migrate`).
    #[arg(
        long,
        env = "OUTBOX_DATABASE_URL",
        default_value = "sqlite://outbox.db",
        global = true,
        help_heading = "Global options"
    )]
    database_url: String,

    /// A file whose first line is the database password (the convention container
    /// platforms use for secrets): it replaces the password of --database-url, which then
    /// needs none.
    #[arg(
        long,
        env = "OUTBOX_DATABASE_PASSWORD_FILE",
        global = true,
        help_heading = "Global options"
    )]
    database_password_file: Option<std::path::PathBuf>,

    /// PostgreSQL schema (or MySQL/SQLite table prefix) holding the outbox tables.
    #[arg(
        long,
        env = "OUTBOX_SCHEMA",
        default_value = "outbox",
        global = true,
        help_heading = "Global options"
    )]
    schema: String,

    /// Largest message accepted at enqueue: payload + topic + key + headers, in bytes.
    /// `migrate` stores it for the SQL entry points (PostgreSQL, MySQL); without the flag
    /// the stored value is kept and used (4 MiB when none is stored).
    #[arg(
        long,
        env = "OUTBOX_MAX_MESSAGE_BYTES",
        global = true,
        help_heading = "Global options"
    )]
    max_message_bytes: Option<usize>,

    /// Config file (TOML; each key is an option's [env: OUTBOX_…] name without OUTBOX_, in
    /// lower case with dashes, e.g. database-url). Default: ./outbox.toml when present.
    #[arg(
        long,
        env = "OUTBOX_CONFIG",
        global = true,
        help_heading = "Global options"
    )]
    config: Option<std::path::PathBuf>,

    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the relay's variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Create or upgrade the outbox schema (idempotent).
    Migrate {
        /// PostgreSQL: turn the insert trigger that wakes relays on or off (off saves
        /// producers one pg_notify per inserting statement; relays then poll).
        #[arg(long, env = "OUTBOX_NOTIFY")]
        notify: Option<bool>,
    },
    /// Enqueue one message in its own transaction (payload from stdin when --payload is absent).
    Enqueue {
        /// Topic, e.g. orders.order-placed.v1.
        #[arg(long)]
        topic: String,
        /// Ordering / partition key.
        #[arg(long)]
        key: Option<String>,
        /// Message id (UUID); a fresh UUIDv7 when absent. Re-using one is idempotent.
        #[arg(long)]
        id: Option<uuid::Uuid>,
        /// Header NAME=VALUE (repeatable).
        #[arg(long = "header", value_parser = parse_header)]
        headers: Vec<(String, String)>,
        /// Payload text; read from stdin when absent.
        #[arg(long)]
        payload: Option<String>,
    },
    /// Run the relay: claim due messages, publish, mark after confirmation.
    Relay {
        /// Sink URL: stdout, file:PATH, nats://HOST:PORT, amqp://…, redis://…, mqtt://…,
        /// http(s)://…; with routes, the catch-all. Required unless --route is given: the
        /// relay refuses to start without a destination (`stdout` prints JSON lines, for
        /// trying it out). NATS, Kafka, RabbitMQ, MQTT and webhook URLs take
        /// `envelope=cloudevents` (webhooks: `outbox_envelope=`) for CloudEvents 1.0.
        #[arg(long, env = "OUTBOX_SINK")]
        sink: Option<String>,
        /// A file whose first line is the password of --sink (which then needs none); a
        /// route's URL takes `password_file=PATH` instead.
        #[arg(long, env = "OUTBOX_SINK_PASSWORD_FILE")]
        sink_password_file: Option<std::path::PathBuf>,
        /// A PEM bundle of certificate authorities every TLS sink trusts besides the
        /// system's roots, unless its URL names its own with `ca=PATH`.
        #[arg(long, env = "OUTBOX_TLS_CA_FILE")]
        tls_ca_file: Option<std::path::PathBuf>,
        /// Route PATTERN=URL (repeatable; first match wins): topics matching PATTERN go to
        /// URL. Patterns are dotted, `*` matches one token, `>` (last) one or more. With
        /// routes, --sink is the catch-all; without it an unmatched topic is quarantined
        /// ("no route for topic …"). In OUTBOX_ROUTE, separate routes by spaces.
        #[arg(long = "route", env = "OUTBOX_ROUTE", value_delimiter = ' ', value_parser = RouteParser)]
        routes: Vec<(String, String)>,
        /// Exit once nothing is due: 0 when every publish succeeded or was quarantined, 3
        /// when some failed and were rescheduled (they are still pending).
        #[arg(long, env = "OUTBOX_DRAIN")]
        drain: bool,
        /// Drain, and when other relays still hold claims at the end (a relay killed a
        /// moment ago holds its rows until their lease ends), wait until those leases have
        /// ended (or nothing is claimed any more), then drain again, so those rows are
        /// delivered too. Implies --drain.
        #[arg(long, env = "OUTBOX_DRAIN_WAIT_LEASES")]
        drain_wait_leases: bool,
        /// What becomes of a confirmed row: `keep` marks it dispatched (history; `outbox
        /// purge` removes old ones), `delete` deletes it at once (no history of delivered
        /// messages; dead letters are kept and replayed as always).
        #[arg(long, env = "OUTBOX_ON_DISPATCH", default_value = "keep", value_parser = ["keep", "delete"])]
        on_dispatch: String,
        /// The most rows per claim. Claims start at --min-batch-size and follow the
        /// backlog: doubling after a full claim, halving after one less than half full.
        #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
        batch_size: u32,
        /// The fewest rows a claim asks for (the size while little is due): 1 to
        /// --batch-size [default: 100, or --batch-size when that is smaller]
        #[arg(long, env = "OUTBOX_MIN_BATCH_SIZE")]
        min_batch_size: Option<u32>,
        /// Claim lease, in ms (at least 30: it is renewed every third of it).
        #[arg(long, env = "OUTBOX_LEASE_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(30..))]
        lease_ms: u64,
        /// Attempts before a failing message is quarantined.
        #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 10, value_parser = clap::value_parser!(i32).range(1..))]
        max_attempts: i32,
        /// Poll interval when no wake-up arrives, in ms.
        #[arg(long, env = "OUTBOX_POLL_INTERVAL_MS", default_value_t = 1_000)]
        poll_interval_ms: u64,
        /// How long each message may wait for its confirmation, in ms (may exceed the
        /// lease: in-flight claims are renewed every third of it).
        #[arg(long, env = "OUTBOX_PUBLISH_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
        publish_timeout_ms: u64,
        /// First retry delay, in ms (doubles per attempt, with jitter).
        #[arg(long, env = "OUTBOX_BACKOFF_BASE_MS", default_value_t = 1_000)]
        backoff_base_ms: u64,
        /// Largest retry delay, in ms.
        #[arg(long, env = "OUTBOX_BACKOFF_MAX_MS", default_value_t = 300_000)]
        backoff_max_ms: u64,
        /// On SIGTERM/SIGINT, how long in-flight publishes may finish before their claims
        /// are released, in ms.
        #[arg(long, env = "OUTBOX_SHUTDOWN_GRACE_MS", default_value_t = 10_000)]
        shutdown_grace_ms: u64,
        /// Name written to claimed_by (default HOSTNAME:PID:RANDOM), 1-255 bytes.
        #[arg(long, env = "OUTBOX_RELAY_ID", value_parser = parse_relay_id)]
        relay_id: Option<String>,
        /// The most batches in flight at once: while one waits for its confirmations,
        /// another is claimed or marked. While little is due one is in flight; more join
        /// after a claim came back full.
        #[arg(long, env = "OUTBOX_IN_FLIGHT_BATCHES", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
        in_flight_batches: u32,
        #[command(flatten)]
        ordering: admin::OrderingArgs,
        /// Serve /metrics (Prometheus), /healthz and /readyz on HOST:PORT (e.g.
        /// 127.0.0.1:9464). Off by default.
        #[arg(long, env = "OUTBOX_METRICS_ADDR")]
        metrics_addr: Option<String>,
        /// Serve the admin server on HOST:PORT inside this relay, as `outbox serve` does
        /// (the dashboard, the API, /metrics, /healthz, /readyz; with this relay's
        /// destinations and their state). Needs a token unless on loopback. Off by default.
        #[arg(long, env = "OUTBOX_ADMIN_ADDR")]
        admin_addr: Option<String>,
        #[command(flatten)]
        auth: dashboard::auth::AuthArgs,
        /// Seconds between summary log lines (delivered, rate, retried, quarantined,
        /// backlog, oldest pending age, destinations down); 0 turns them off.
        #[arg(long, env = "OUTBOX_SUMMARY_INTERVAL_S", default_value_t = 60, value_parser = clap::value_parser!(u64).range(0..=86_400))]
        summary_interval_s: u64,
        /// Seconds between store samples for the store gauges (taken by one relay at a
        /// time: the live relay with the smallest id); 0 turns them off. Without
        /// --metrics-addr or --admin-addr nothing would read them, so none are taken.
        #[arg(long, env = "OUTBOX_SAMPLE_INTERVAL_S", default_value_t = 15, value_parser = clap::value_parser!(u64).range(0..=86_400))]
        sample_interval_s: u64,
        /// Export a producer span per published message (`send TOPIC`, a child of the
        /// message's stored `traceparent`) over OTLP/HTTP with protobuf to this URL, e.g.
        /// http://127.0.0.1:4318 (spans go to URL/v1/traces), as service `outbox-relay`.
        /// Messages then carry that span's `traceparent` on the wire. Off by default.
        #[arg(long, env = "OUTBOX_OTLP_ENDPOINT")]
        otlp_endpoint: Option<String>,
    },
    /// Serve the admin dashboard: the page at /, a JSON API under /api/ (status, dead
    /// letters, replay, discard, the audit, pauses, message search), /metrics, /healthz
    /// and /readyz. Every request but the page and the probes needs a bearer token
    /// (OUTBOX_ADMIN_TOKEN, OUTBOX_ADMIN_READ_TOKEN or --admin-tokens-file); without one it
    /// listens on loopback only.
    Serve {
        /// HOST:PORT to listen on.
        #[arg(long, env = "OUTBOX_ADMIN_LISTEN", default_value = "127.0.0.1:8080")]
        listen: String,
        #[command(flatten)]
        auth: dashboard::auth::AuthArgs,
        #[command(flatten)]
        limits: admin::LimitsArgs,
        // As the relays run: which dead letters block their key.
        #[command(flatten)]
        ordering: admin::OrderingArgs,
    },
    /// Show counts by status, due and expired claims, live relays, pauses and a verdict
    /// (OK, STUCK, BLOCKED, BEHIND, DEAD, PAUSED).
    Status {
        /// One JSON object: pending, claimed, dispatched, dead, oldest_pending_age_seconds,
        /// paused, due, relays, topic_pauses, verdict, ….
        #[arg(long)]
        json: bool,
        /// Also the 10 largest topics of pending and of dead rows.
        #[arg(long)]
        by_topic: bool,
        /// Exit 1 unless the verdict is OK (for cron jobs and probes).
        #[arg(long)]
        check: bool,
        #[command(flatten)]
        limits: admin::LimitsArgs,
        // With --ordered, rows of ordered keys waiting behind dead letters are BLOCKED,
        // not STUCK or BEHIND.
        #[command(flatten)]
        ordering: admin::OrderingArgs,
    },
    /// Stop relays from publishing: every topic, or (with --topic) only matching topics
    /// while the others flow. Producers keep writing.
    Pause {
        /// Why (shown by `status` and in relay logs).
        #[arg(long)]
        reason: String,
        /// Pause only topics matching this pattern (orders.>, *.v1).
        #[arg(long)]
        topic: Option<String>,
        /// Who (shown by `status`; default $USER).
        #[arg(long, env = "USER", default_value = "unknown")]
        by: String,
    },
    /// Let relays publish again (with --topic: lift that topic pause).
    Resume {
        /// The topic pattern to resume, exactly as paused.
        #[arg(long)]
        topic: Option<String>,
        /// Why (kept in the audit, `outbox replays`; optional).
        #[arg(long, default_value = "")]
        reason: String,
        /// Who (kept in the audit; default $USER).
        #[arg(long, env = "USER", default_value = "unknown")]
        by: String,
    },
    /// Dead letters: list, show, discard.
    #[command(subcommand)]
    Dead(admin::DeadCommand),
    /// Move dead letters back to pending (same message id, attempts reset), audited.
    Replay {
        #[command(flatten)]
        change: admin::ChangeArgs,
        /// Spread the replayed rows' availability at this many per second (e.g. 50).
        #[arg(long, value_parser = parse_rate)]
        rate: Option<f64>,
    },
    /// The audit of replays, discards, dead-row purges, pauses and resumes.
    #[command(subcommand)]
    Replays(admin::ReplaysCommand),
    /// Delete dispatched rows older than the retention, in bounded batches (pending,
    /// claimed and dead rows are never touched). Prints `{"deleted":N,"locked_out":BOOL}`;
    /// when another purge is running it stops, says so on stderr and exits 0. With
    /// --dead-older-than, deletes dead rows older than that instead (audited).
    Purge {
        /// Delete dead rows that died longer ago than this (30d), as one audited
        /// operation, instead of dispatched rows.
        #[arg(long, value_parser = admin::parse_duration)]
        dead_older_than: Option<Duration>,
        /// Who, for the audit row of a dead-row purge (default $USER).
        #[arg(long, env = "USER", default_value = "unknown")]
        by: String,
        /// Delete more than 1,000 dead rows without asking (a prompt on a terminal; a
        /// script without it is refused).
        #[arg(long)]
        yes: bool,
        /// Keep dispatched rows younger than this many seconds.
        #[arg(long, env = "OUTBOX_RETENTION_S", default_value_t = 7 * 24 * 3600)]
        older_than_s: u64,
        /// Rows per delete statement.
        #[arg(long, env = "OUTBOX_PURGE_BATCH_SIZE", default_value_t = 1_000)]
        batch_size: u32,
        /// Pause between batches, in ms (gives producers room on a busy database).
        #[arg(long, env = "OUTBOX_PURGE_PAUSE_MS", default_value_t = 0)]
        pause_ms: u64,
    },
    /// The consumer inbox (deduplication rows written by `inbox_accept`).
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// A self-contained run on SQLite in a temporary directory (the global options do not
    /// apply: the demo makes its own databases).
    Demo {
        /// Orders to place: at least 200, so that relay 1 reaches its third batch of 50
        /// (where it crashes).
        #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u32).range(200..))]
        orders: u32,
    },
}

/// `outbox inbox …`
#[derive(Subcommand, Debug)]
enum InboxCommand {
    /// Delete inbox rows received longer ago than --older-than (database clock), oldest
    /// first, in bounded batches. Prints `{"deleted":N}`. A message whose row is gone is
    /// fresh again to its consumer, so ages under 1h are refused: brokers redeliver
    /// unacknowledged messages within their ack wait / visibility timeout, and a dedup row
    /// must outlive every redelivery.
    Purge {
        /// Keep rows younger than this (e.g. 7d, 36h); at least 1h.
        #[arg(long, value_parser = parse_inbox_age)]
        older_than: Duration,
        /// Rows per delete statement.
        #[arg(long, default_value_t = 1_000)]
        batch_size: u32,
        /// Pause between batches, in ms (gives consumers room on a busy database).
        #[arg(long, env = "OUTBOX_INBOX_PURGE_PAUSE_MS", default_value_t = 0)]
        pause_ms: u64,
    },
}

/// An inbox retention age: a duration of at least [`outbox::inbox::MIN_RETENTION`].
fn parse_inbox_age(s: &str) -> Result<Duration, String> {
    let d = admin::parse_duration(s)?;
    if d < outbox::inbox::MIN_RETENTION {
        return Err(format!(
            "{s:?} is shorter than the minimum inbox retention of {}: a dedup row must outlive \
             every redelivery of its message (brokers redeliver unacknowledged messages after \
             their ack wait or visibility timeout), or a late duplicate is processed again",
            humantime_fmt(outbox::inbox::MIN_RETENTION)
        ));
    }
    Ok(d)
}

/// `--min-batch-size` when not given (or `--batch-size`, when that is smaller).
const DEFAULT_MIN_BATCH_SIZE: u32 = 100;

/// Why `relay` refuses to start without a destination, and how to give it one.
const NO_SINK: &str = "the relay has no sink: nothing says where messages go, so it refuses \
to start (it would mark them dispatched without delivering them anywhere). Choose one with \
--sink URL (e.g. --sink nats://127.0.0.1:4222), the OUTBOX_SINK environment variable, \
sink = \"URL\" in outbox.toml, or --route PATTERN=URL. To try the relay out, --sink stdout \
prints each message as a JSON line.";

/// `--route PATTERN=URL`. Its errors show the route redacted: clap's own message for a
/// value it refuses would repeat the value as given, password included.
#[derive(Clone)]
struct RouteParser;

impl clap::builder::TypedValueParser for RouteParser {
    type Value = (String, String);

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Self::Value, clap::Error> {
        let refuse = |kind, reason: String| {
            clap::Error::raw(kind, format!("invalid --route: {reason}\n")).with_cmd(cmd)
        };
        let text = value.to_str().ok_or_else(|| {
            refuse(
                clap::error::ErrorKind::InvalidUtf8,
                "the value is not UTF-8".into(),
            )
        })?;
        parse_route(text).map_err(|e| refuse(clap::error::ErrorKind::ValueValidation, e))
    }
}

fn parse_route(s: &str) -> Result<(String, String), String> {
    // Without its pattern the text may be a URL whose user name is a token
    // (`nats://TOKEN@host`): the whole userinfo is hidden.
    let shown = || outbox::redact::redact_unknown_url(s);
    let (pattern, url) = s
        .split_once('=')
        .ok_or_else(|| format!("route {:?} must be PATTERN=URL", shown()))?;
    if pattern.contains("://") || pattern.contains('@') {
        // No pattern before the URL: the `=` was the URL's own.
        return Err(format!("route {:?} must be PATTERN=URL", shown()));
    }
    outbox::sink::router::TopicPattern::parse(pattern)?;
    Ok((pattern.to_owned(), url.to_owned()))
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let n = s.trim();
    let n = n.strip_suffix("/s").unwrap_or(n);
    match n.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!(
            "rate {s:?} must be a positive number per second, e.g. 50 or 50/s"
        )),
    }
}

/// A relay id of 1 to [`outbox::relay::MAX_RELAY_ID_BYTES`] bytes (what the stores'
/// `claimed_by` holds).
fn parse_relay_id(s: &str) -> Result<String, String> {
    let max = outbox::relay::MAX_RELAY_ID_BYTES;
    if s.is_empty() || s.len() > max {
        return Err(format!("a relay id must be 1-{max} bytes, got {}", s.len()));
    }
    Ok(s.to_owned())
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("header {s:?} must be NAME=VALUE"))
}

/// Raises the soft limit on open files (`RLIMIT_NOFILE`) to the hard limit, as servers
/// do: the relay's store and broker connections, its file sinks and its HTTP listeners
/// (at most 256 connections each) then share the most descriptors the system allows this
/// process. Best effort: a refusal is logged at debug and the process goes on.
fn raise_open_files_limit() {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into `limit`, a valid rlimit owned here.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "cannot read the open-files limit");
            return;
        }
        if limit.rlim_cur >= limit.rlim_max {
            return;
        }
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads `raised`, a valid rlimit owned here.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const raised) } == 0 {
            tracing::debug!(
                from = limit.rlim_cur,
                to = limit.rlim_max,
                "open-files limit raised to the hard limit"
            );
        } else {
            tracing::debug!(error = %std::io::Error::last_os_error(), soft = limit.rlim_cur, hard = limit.rlim_max, "cannot raise the open-files limit");
        }
    }
}

/// The command line, parsed with every environment value hidden from `--help` (URLs,
/// routes and tokens come from there). A usage error is printed with every URL it quotes
/// redacted ([`redact_urls_in`]); `--help` and `--version` as clap prints them. The exit
/// code is clap's: 2 for a usage error, 0 for `--help` and `--version`.
fn parse_args() -> Result<Cli, ExitCode> {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let command = hide_env_values(Cli::command());
    command
        .try_get_matches_from(std::env::args_os())
        .and_then(|m| Cli::from_arg_matches(&m))
        .map_err(|e| {
            if e.use_stderr() {
                eprint!("{}", redact_urls_in(&e.render().to_string()));
            } else {
                // --help and --version: text of the program's own, environment values
                // hidden.
                let _ = e.print();
            }
            ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2))
        })
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
        return ExitCode::from(2);
    }
    let cli = match parse_args() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    // Before the runtime: the exporter's HTTP client is a blocking one.
    let tracer = match &cli.command {
        Command::Relay {
            otlp_endpoint: Some(url),
            ..
        } if !url.is_empty() => match otlp::provider(url) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("error: {}", error_chain(&e));
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    init_logs(tracer.as_ref());
    raise_open_files_limit();
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
    let code = match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    };
    drop(runtime);
    if let Some(p) = &tracer {
        otlp::shutdown(p);
    }
    code
}

/// Log lines on stderr, filtered by `OUTBOX_LOG`; with a tracer provider, also the
/// relay's spans to it (each layer with its own filter, so `OUTBOX_LOG` does not decide
/// which spans are exported).
fn init_logs(tracer: Option<&opentelemetry_sdk::trace::SdkTracerProvider>) {
    use tracing_subscriber::prelude::*;
    let filter = log_filter(std::env::var("OUTBOX_LOG").ok().as_deref());
    match tracer {
        None => tracing_subscriber::registry()
            .with(filter)
            .with(log_lines())
            .init(),
        Some(p) => tracing_subscriber::registry()
            .with(log_lines().with_filter(filter))
            .with(otlp::layer(p))
            .init(),
    }
}

/// The log line layer: plain text on stderr, colours only on a terminal.
fn log_lines<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
}

/// The log filter when `OUTBOX_LOG` is unset or empty: the relay's own lines at info;
/// the libraries' are held to errors by [`QUIET_TARGETS`].
const DEFAULT_LOG: &str = "info";

/// Client libraries and their chatter, with the most they may log: lapin warns with a
/// returned message's headers and payload bytes, the network clients dump packets, frames
/// or commands at debug and trace and warn about reconnects the relay reports itself (one
/// line per outage), and sqlx warns with its statements (`sqlx::query`: slow statements
/// with their SQL), its pool (`sqlx::pool::acquire`: slow acquires during a database
/// outage) and its connect options (`sqlx_postgres`: an unrecognized URL parameter with its
/// value, such as `sslpassword=`). Appended to every filter, `OUTBOX_LOG=trace` included,
/// unless the filter names exactly that target itself (an explicit
/// `OUTBOX_LOG=info,lapin=debug` is the operator's choice; naming one module,
/// `lapin::channel=trace` or `sqlx::query=debug`, leaves the rest of the crate quiet). A
/// target matches every target it begins (`sqlx` covers `sqlx_core` and `sqlx_postgres`).
const QUIET_TARGETS: [(&str, &str); 12] = [
    ("lapin", "error"),
    ("amq_protocol", "error"),
    ("sqlx", "error"),
    ("async_nats", "error"),
    ("rumqttc", "error"),
    ("redis", "error"),
    ("reqwest", "error"),
    ("hyper", "error"),
    ("hyper_util", "error"),
    ("h2", "error"),
    ("rdkafka", "error"),
    ("rustls", "error"),
];

/// The `EnvFilter` directives for `OUTBOX_LOG` (or [`DEFAULT_LOG`]) plus [`QUIET_TARGETS`]
/// for every target the user's directives do not name. An unparsable `OUTBOX_LOG` falls
/// back to the default.
fn log_filter_directives(user: Option<&str>) -> String {
    let base = user
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .unwrap_or(DEFAULT_LOG);
    let named = |target: &str| {
        base.split(',').any(|d| {
            let t = d.split(['=', '[']).next().unwrap_or_default().trim();
            t == target
        })
    };
    let mut directives = base.to_owned();
    for (target, level) in QUIET_TARGETS {
        if !named(target) {
            directives.push_str(&format!(",{target}={level}"));
        }
    }
    directives
}

fn log_filter(user: Option<&str>) -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_new(log_filter_directives(user)).unwrap_or_else(|e| {
        eprintln!("warning: OUTBOX_LOG is not a valid filter ({e}); using {DEFAULT_LOG:?}");
        tracing_subscriber::EnvFilter::new(log_filter_directives(None))
    })
}

/// The error and its causes, each once (many errors repeat their source's text).
fn error_chain(e: &anyhow::Error) -> String {
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

/// Prints a line to stdout; a closed pipe (`outbox status | head -1`) ends quietly.
fn out(line: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "{line}")
        .and_then(|()| stdout.flush())
        .is_err()
    {
        std::process::exit(0);
    }
}

/// Opens the store. `create` allows a missing SQLite file to be created (migrate only);
/// every other command refuses a missing file, rather than leave an empty one behind.
async fn connect(cli: &Cli, create: bool) -> anyhow::Result<AnyStore> {
    let url = &match &cli.database_password_file {
        Some(file) => with_password_file(&cli.database_url, file)?,
        None => cli.database_url.clone(),
    };
    if !create && let Some(path) = sqlite_path(url) {
        anyhow::ensure!(
            std::path::Path::new(path).exists(),
            "no outbox database at {path}: run `outbox migrate` (with the same --database-url) first"
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

/// `url` with its password replaced by the first line of `file`.
fn with_password_file(url: &str, file: &std::path::Path) -> anyhow::Result<String> {
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
fn sqlite_path(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("sqlite:")?;
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    Some(rest.split('?').next().unwrap_or(rest))
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match &cli.command {
        Command::Demo { orders } => demo::run(*orders).await,
        Command::Migrate { notify } => {
            let store = connect(&cli, true).await?;
            store.migrate().await.context("migration failed")?;
            if let Some(on) = notify {
                match &store {
                    AnyStore::Postgres(pg) => pg.set_notify(*on).await?,
                    _ => anyhow::bail!("--notify applies to PostgreSQL only"),
                }
            }
            eprintln!("outbox schema {:?} is migrated", cli.schema);
            Ok(ExitCode::SUCCESS)
        }
        Command::Enqueue {
            topic,
            key,
            id,
            headers,
            payload,
        } => {
            let store = connect(&cli, false).await?;
            store.check_schema().await?;
            let payload = match payload {
                Some(p) => p.clone().into_bytes(),
                None => {
                    use tokio::io::AsyncReadExt;
                    let mut buf = Vec::new();
                    tokio::io::stdin().read_to_end(&mut buf).await?;
                    buf
                }
            };
            let mut msg = Message::new(topic.clone(), payload);
            if let Some(k) = key {
                msg = msg.key(k.clone());
            }
            if let Some(id) = id {
                msg = msg.message_id(*id);
            }
            for (k, v) in headers {
                msg = msg.header(k.clone(), v.clone());
            }
            let enqueued = store.enqueue_alone(&msg).await?;
            out(&serde_json::json!({"id": enqueued.id, "message_id": enqueued.message_id, "inserted": enqueued.inserted}).to_string());
            Ok(ExitCode::SUCCESS)
        }
        Command::Relay {
            sink,
            sink_password_file,
            tls_ca_file,
            routes,
            drain,
            drain_wait_leases,
            on_dispatch,
            batch_size,
            min_batch_size,
            lease_ms,
            max_attempts,
            poll_interval_ms,
            publish_timeout_ms,
            backoff_base_ms,
            backoff_max_ms,
            shutdown_grace_ms,
            relay_id,
            in_flight_batches,
            metrics_addr,
            admin_addr,
            auth,
            summary_interval_s,
            sample_interval_s,
            ordering,
            otlp_endpoint: _,
        } => {
            if routes.is_empty() && sink.is_none() {
                // A missing OUTBOX_SINK must not empty the outbox into a log.
                eprintln!("error: {NO_SINK}");
                return Ok(ExitCode::from(2));
            }
            let min_batch_size = match *min_batch_size {
                Some(min) if min == 0 || min > *batch_size => {
                    eprintln!(
                        "error: --min-batch-size ({min}) must be from 1 to --batch-size ({batch_size})"
                    );
                    return Ok(ExitCode::from(2));
                }
                Some(min) => min,
                None => DEFAULT_MIN_BATCH_SIZE.min(*batch_size),
            };
            if backoff_max_ms < backoff_base_ms {
                eprintln!(
                    "error: --backoff-max-ms ({backoff_max_ms}) must be at least --backoff-base-ms ({backoff_base_ms})"
                );
                return Ok(ExitCode::from(2));
            }
            let store = Arc::new(connect(&cli, false).await?);
            outbox::sink::tls::set_default_ca(tls_ca_file.clone());
            let sink = match (sink, sink_password_file) {
                (Some(url), Some(file)) => Some(with_password_file(url, file)?),
                (sink, _) => sink.clone(),
            };
            let open = || open_sink(sink.as_deref(), routes);
            let mut config = RelayConfig {
                batch_size: *batch_size,
                min_batch_size,
                lease: Duration::from_millis(*lease_ms),
                max_attempts: *max_attempts,
                poll_interval: Duration::from_millis(*poll_interval_ms),
                publish_timeout: Duration::from_millis(*publish_timeout_ms),
                backoff_base: Duration::from_millis(*backoff_base_ms),
                backoff_max: Duration::from_millis(*backoff_max_ms),
                shutdown_grace: Duration::from_millis(*shutdown_grace_ms),
                drain: *drain || *drain_wait_leases,
                in_flight_batches: *in_flight_batches,
                summary_interval: Duration::from_secs(*summary_interval_s),
                // The gauges are only read through --metrics-addr: without it, sampling
                // would be statements for nobody.
                sample_interval: if metrics_addr.is_some() || admin_addr.is_some() {
                    Duration::from_secs(*sample_interval_s)
                } else {
                    Duration::ZERO
                },
                on_dispatch: if on_dispatch == "delete" {
                    outbox::OnDispatch::Delete
                } else {
                    outbox::OnDispatch::Keep
                },
                ordering: ordering.ordering(),
                ..RelayConfig::default()
            };
            if let Some(id) = relay_id {
                config.relay_id = id.clone();
            }
            let cancel = CancellationToken::new();
            tokio::spawn(shutdown_on_signal(cancel.clone()));
            let ready = Arc::new(serve::Ready::new(
                store.clone(),
                sqlite_path(&cli.database_url).map(std::path::PathBuf::from),
                true,
            ));
            let tokens = match admin_addr {
                Some(_) => match dashboard::auth::Tokens::load(auth) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        eprintln!("error: {}", error_chain(&e));
                        return Ok(ExitCode::from(2));
                    }
                },
                None => None,
            };
            let recorder = if metrics_addr.is_some() || admin_addr.is_some() {
                Some(serve::recorder()?)
            } else {
                None
            };
            if let (Some(addr), Some(handle)) = (metrics_addr, &recorder) {
                serve::start(addr, handle.clone(), ready.clone(), cancel.clone()).await?;
            }
            if let (Some(addr), Some(handle), Some(tokens)) = (admin_addr, &recorder, tokens) {
                let admin = dashboard::Admin {
                    store: store.clone(),
                    ready: ready.clone(),
                    limits: admin::Limits::default(),
                    ordering: config.ordering.clone(),
                };
                dashboard::start(
                    "--admin-addr",
                    addr,
                    tokens,
                    admin,
                    handle.clone(),
                    cancel.clone(),
                )
                .await?;
            }
            let relay = |router| {
                let relay = Relay::with_router(store.clone(), router, config.clone());
                *ready.relay.write().unwrap_or_else(|p| p.into_inner()) = Some(relay.health());
                *ready.router.write().unwrap_or_else(|p| p.into_inner()) =
                    Some(relay.router().clone());
                relay
            };
            let sink = open().await?;
            let stats = match relay(sink).run(cancel.clone()).await {
                Err(e @ outbox::RelayError::IdTaken { .. }) => {
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
                r => r?,
            };
            if !config.drain {
                return Ok(ExitCode::SUCCESS);
            }
            let mut retried = stats.retried;
            // Rows other relays still hold (one killed a moment ago holds its claims until
            // their lease ends): say so, and with --drain-wait-leases wait for those leases,
            // then drain again. Only the leases seen here are waited for; later claims
            // belong to relays that are running.
            let mut wait_until: Option<tokio::time::Instant> = None;
            while !cancel.is_cancelled() {
                let leases = store.leases().await?;
                let (held, ends_in) = match (leases.held, leases.last_ends_in) {
                    (0, _) | (_, None) => break,
                    (held, Some(ends_in)) => (held, ends_in),
                };
                let now = tokio::time::Instant::now();
                let deadline = *wait_until.get_or_insert(now + ends_in);
                if !*drain_wait_leases || now >= deadline {
                    eprintln!(
                        "drain finished, but {} still claimed by other relays (running, or stopped without releasing them); their leases end within {:.1} s, after which any relay delivers them{}",
                        if held == 1 {
                            "1 row is".to_owned()
                        } else {
                            format!("{held} rows are")
                        },
                        ends_in.as_secs_f64(),
                        if *drain_wait_leases {
                            ""
                        } else {
                            " (--drain-wait-leases waits for that)"
                        }
                    );
                    break;
                }
                eprintln!(
                    "{} claimed by other relays; waiting up to {:.1} s for their leases to end, then draining again",
                    if held == 1 {
                        "1 row is".to_owned()
                    } else {
                        format!("{held} rows are")
                    },
                    deadline.saturating_duration_since(now).as_secs_f64()
                );
                // Until the leases end, or nothing is claimed any more (the other relay
                // settled or released its rows).
                loop {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(left.min(Duration::from_secs(1))) => {}
                        _ = cancel.cancelled() => break,
                    }
                    if store.leases().await?.held == 0 {
                        break;
                    }
                }
                if cancel.is_cancelled() {
                    break;
                }
                // The sink was closed when the last run stopped: a new one for this run.
                let stats = relay(open().await?).run(cancel.clone()).await?;
                retried += stats.retried;
            }
            if retried > 0 {
                eprintln!(
                    "drain finished, but {} (see the warnings above): {} still pending",
                    if retried == 1 {
                        "1 publish failed and was rescheduled".to_owned()
                    } else {
                        format!(
                            "{} publishes failed and were rescheduled",
                            admin::group(retried as i64)
                        )
                    },
                    if retried == 1 {
                        "that message is"
                    } else {
                        "those messages are"
                    },
                );
                return Ok(ExitCode::from(3));
            }
            // Rows not due yet (delayed, or waiting for a retry an earlier run scheduled)
            // are not this run's failures, but a drain must not hide them.
            let pending = store.counts().await?.pending;
            if pending > 0 {
                eprintln!(
                    "drain finished, with {} still pending: not due yet (delayed messages, retries scheduled earlier, rows parked behind dead letters), held behind an earlier row of their key (per-key ordering), of a paused topic, or written after the drain's last claim; `outbox status` shows them",
                    admin::counted(pending, "row"),
                );
                let paused = admin::paused_topics(store.as_ref()).await?;
                if !paused.is_empty() {
                    eprintln!(
                        "topics paused (their rows stay pending until `outbox resume --topic PATTERN`): {}",
                        paused.join(", ")
                    );
                }
            }
            if config.ordering.holds_dead() {
                let held = store.held_keys(&config.ordering).await?;
                if held.held > 0 {
                    eprintln!(
                        "{} of them {} behind the dead letters of {}: `outbox dead list --ordered …` marks them BLOCKS; `outbox replay` or `outbox dead discard` releases each key",
                        admin::group(held.held),
                        if held.held == 1 { "waits" } else { "wait" },
                        admin::counted(held.blocked_keys, "ordered key")
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve {
            listen,
            auth,
            limits,
            ordering,
        } => {
            let tokens = match dashboard::auth::Tokens::load(auth) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: {}", error_chain(&e));
                    return Ok(ExitCode::from(2));
                }
            };
            let store = Arc::new(connect(&cli, false).await?);
            store.check_schema().await?;
            let cancel = CancellationToken::new();
            tokio::spawn(shutdown_on_signal(cancel.clone()));
            let ready = Arc::new(serve::Ready::new(
                store.clone(),
                sqlite_path(&cli.database_url).map(std::path::PathBuf::from),
                false,
            ));
            let admin = dashboard::Admin {
                store,
                ready,
                limits: limits.limits(),
                ordering: ordering.ordering(),
            };
            dashboard::start(
                "--listen",
                listen,
                tokens,
                admin,
                serve::recorder()?,
                cancel.clone(),
            )
            .await?;
            cancel.cancelled().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Status {
            json,
            by_topic,
            check,
            limits,
            ordering,
        } => {
            let store = connect(&cli, false).await?;
            store.check_schema().await?;
            admin::status(
                &store,
                *json,
                *by_topic,
                *check,
                limits.limits(),
                &ordering.ordering(),
            )
            .await
        }
        Command::Pause { reason, topic, by } => {
            let store = connect(&cli, false).await?;
            store.check_schema().await?;
            eprintln!(
                "{}",
                admin::pause(&store, topic.as_deref(), reason, by).await?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Dead(cmd) => {
            let store = connect(&cli, false).await?;
            store.check_schema().await?;
            admin::dead(&store, cmd).await
        }
        Command::Replay { change, rate } => {
            let store = connect(&cli, false).await?;
            store.check_schema().await?;
            admin::change_dead(&store, change, outbox::store::ReplayAction::Replay, *rate).await
        }
        Command::Replays(cmd) => {
            let store = connect(&cli, false).await?;
            store.check_schema().await?;
            admin::replays(&store, cmd).await
        }
        Command::Purge {
            dead_older_than,
            by,
            yes,
            older_than_s,
            batch_size,
            pause_ms,
        } => {
            let store = connect(&cli, false).await?;
            store.check_schema().await?;
            anyhow::ensure!(*batch_size > 0, "--batch-size must be at least 1");
            if let Some(age) = dead_older_than {
                let reason = format!(
                    "dead-row retention: died more than {} ago",
                    humantime_fmt(*age)
                );
                let deleted =
                    admin::purge_dead(&store, *age, *batch_size, by, &reason, *yes).await?;
                out(&serde_json::json!({ "dead_deleted": deleted }).to_string());
                return Ok(ExitCode::SUCCESS);
            }
            let mut total = 0u64;
            let mut locked_out = false;
            loop {
                let b = store
                    .purge(Duration::from_secs(*older_than_s), *batch_size)
                    .await?;
                if b.locked_out {
                    // Not a failure: the other purger does the same work (a cron job that
                    // overlaps the previous run must not page anyone).
                    eprintln!(
                        "another purge is running on this outbox; this one stops, having deleted {}",
                        admin::counted(total as i64, "row"),
                    );
                    locked_out = true;
                    break;
                }
                total += b.deleted;
                if b.deleted < u64::from(*batch_size) {
                    break;
                }
                if *pause_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(*pause_ms)).await;
                }
            }
            out(&serde_json::json!({ "deleted": total, "locked_out": locked_out }).to_string());
            Ok(ExitCode::SUCCESS)
        }
        Command::Inbox(InboxCommand::Purge {
            older_than,
            batch_size,
            pause_ms,
        }) => {
            let store = connect(&cli, false).await?;
            store.check_schema().await?;
            anyhow::ensure!(*batch_size > 0, "--batch-size must be at least 1");
            let mut total = 0u64;
            loop {
                let n = store.inbox_purge(*older_than, *batch_size).await?;
                total += n;
                if n < u64::from(*batch_size) {
                    break;
                }
                if *pause_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(*pause_ms)).await;
                }
            }
            out(&serde_json::json!({ "deleted": total }).to_string());
            Ok(ExitCode::SUCCESS)
        }
        Command::Resume { topic, reason, by } => {
            let store = connect(&cli, false).await?;
            store.check_schema().await?;
            eprintln!(
                "{}",
                admin::resume(&store, topic.as_deref(), reason, by).await?
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The relay's sink: `sink` alone, or a router over `routes` with `sink` as the catch-all.
async fn open_sink(
    sink: Option<&str>,
    routes: &[(String, String)],
) -> anyhow::Result<outbox::sink::router::Router> {
    match sink {
        Some(url) if routes.is_empty() => {
            let sink: Arc<dyn outbox::Sink> = Arc::from(outbox::sink::open(url).await?);
            Ok(outbox::sink::router::Router::single(sink))
        }
        _ => {
            let mut all = routes.to_vec();
            if let Some(catch_all) = sink {
                all.push((">".to_owned(), catch_all.to_owned()));
            }
            Ok(outbox::sink::router::Router::open(&all, Default::default()).await?)
        }
    }
}

/// A duration as humans write it (`30days`, `1h 30m`).
fn humantime_fmt(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Cancels on SIGTERM or SIGINT (Ctrl-C).
async fn shutdown_on_signal(cancel: CancellationToken) {
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
    use super::log_filter_directives;

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

    #[test]
    fn inbox_purge_ages_below_the_redelivery_window_are_refused() {
        use std::time::Duration;
        assert_eq!(super::parse_inbox_age("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(
            super::parse_inbox_age("7d"),
            Ok(Duration::from_secs(7 * 86400))
        );
        for short in ["59m", "30s", "0s"] {
            let Err(e) = super::parse_inbox_age(short) else {
                panic!("{short} was accepted");
            };
            assert!(e.contains("minimum inbox retention of 1h"), "{e}");
        }
        assert!(super::parse_inbox_age("soon").is_err());
    }

    #[test]
    fn body_logging_targets_are_quiet_unless_named() {
        let d = log_filter_directives(Some("trace"));
        assert!(d.starts_with("trace,"), "{d}");
        assert!(
            d.contains(",lapin=error") && d.contains(",rumqttc=error"),
            "{d}"
        );
        let d = log_filter_directives(Some("info,lapin=debug"));
        assert!(!d.contains("lapin=error"), "{d}");
        assert!(d.contains("async_nats=error"), "{d}");
        // A module of the target: the rest of the target stays quiet (the most specific
        // directive wins for that module).
        let d = log_filter_directives(Some("lapin::channel[x]=trace"));
        assert!(d.contains("lapin=error"), "{d}");
        let d = log_filter_directives(None);
        assert!(d.starts_with("info,lapin=error"), "{d}");
        assert!(d.contains(",sqlx=error,"), "{d}");
        // A module of sqlx named: the rest of sqlx stays quiet.
        let d = log_filter_directives(Some("info,sqlx::query=debug"));
        assert!(d.contains(",sqlx=error"), "{d}");
        assert_eq!(
            log_filter_directives(Some("  ")),
            log_filter_directives(None)
        );
    }
}
