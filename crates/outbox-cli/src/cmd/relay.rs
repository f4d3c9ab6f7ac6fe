//! `outbox relay`: claim due messages, publish them, mark them after confirmation;
//! with `--drain`, until nothing is due.

use super::pause::paused_topics;
use crate::dashboard;
use crate::serve;
use crate::shared::{
    DRAIN_QUARANTINED, DRAIN_RETRIED, GlobalArgs, Missing, USAGE, connect, error_chain,
    shutdown_on_signal, sqlite_path, with_password_file,
};
use crate::text::{counted, group};
use outbox::store::prelude::*;
use outbox::{Relay, RelayConfig};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// `--min-batch-size` when not given (or `--batch-size`, when that is smaller).
const DEFAULT_MIN_BATCH_SIZE: u32 = 100;

/// Why `relay` refuses to start without a destination, and how to give it one.
const NO_SINK: &str = "the relay has no sink: nothing says where messages go, so it refuses \
to start (it would mark them dispatched without delivering them anywhere). Choose one with \
--sink URL (e.g. --sink nats://127.0.0.1:4222), the OUTBOX_SINK environment variable, \
sink = \"URL\" in outbox.toml, or --route PATTERN=URL. To try the relay out, --sink stdout \
prints each message as a JSON line.";

/// `outbox relay`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Sink URL: stdout, file:PATH, nats://HOST:PORT, amqp://…, redis://…,
    /// sidekiq://…?class=JobClass, mqtt://…, http(s)://…; with routes, the catch-all. Required unless --route is given: the
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
    /// Exit once nothing is due: 0 when every publish succeeded, 3 when some failed and
    /// were rescheduled (they are still pending), 4 when none failed but some messages
    /// were quarantined as dead letters during the drain.
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
    /// At start, create a JetStream stream for each --route to NATS whose pattern no
    /// stream covers: named after the pattern (`orders.>` → ORDERS), subjects the
    /// pattern, file storage, one replica, the server's default duplicate window (2 min).
    /// Without it, the relay only checks and says on stderr which routes no stream
    /// covers (their messages would be quarantined). A stream that covers part of a
    /// pattern is never changed.
    #[arg(long, env = "OUTBOX_CREATE_MISSING")]
    create_missing: bool,
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
    ordering: super::OrderingArgs,
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
    pub(crate) otlp_endpoint: Option<String>,
}

/// Runs `outbox relay`.
pub(crate) async fn run(global: &GlobalArgs, args: &Args) -> anyhow::Result<ExitCode> {
    let Args {
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
        ordering,
        metrics_addr,
        admin_addr,
        auth,
        summary_interval_s,
        sample_interval_s,
        create_missing,
        ..
    } = args;
    if routes.is_empty() && sink.is_none() {
        // A missing OUTBOX_SINK must not empty the outbox into a log.
        eprintln!("error: {NO_SINK}");
        return Ok(ExitCode::from(USAGE));
    }
    let min_batch_size = match *min_batch_size {
        Some(min) if min == 0 || min > *batch_size => {
            eprintln!(
                "error: --min-batch-size ({min}) must be from 1 to --batch-size ({batch_size})"
            );
            return Ok(ExitCode::from(USAGE));
        }
        Some(min) => min,
        None => DEFAULT_MIN_BATCH_SIZE.min(*batch_size),
    };
    if backoff_max_ms < backoff_base_ms {
        eprintln!(
            "error: --backoff-max-ms ({backoff_max_ms}) must be at least --backoff-base-ms ({backoff_base_ms})"
        );
        return Ok(ExitCode::from(USAGE));
    }
    let store = Arc::new(connect(global, Missing::Refuse).await?);
    outbox::sink::tls::set_default_ca(tls_ca_file.clone());
    let sink = match (sink, sink_password_file) {
        (Some(url), Some(file)) => Some(with_password_file(url, file)?),
        (sink, _) => sink.clone(),
    };
    let open = || open_sink(sink.as_deref(), routes);
    check_streams(routes, *create_missing).await;
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
        sqlite_path(&global.database_url).map(std::path::PathBuf::from),
        true,
    ));
    let tokens = match admin_addr {
        Some(_) => match dashboard::auth::Tokens::load(auth) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("error: {}", error_chain(&e));
                return Ok(ExitCode::from(USAGE));
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
            limits: outbox::verdict::Limits::default(),
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
        *ready.router.write().unwrap_or_else(|p| p.into_inner()) = Some(relay.router().clone());
        relay
    };
    let sink = open().await?;
    let stats = match relay(sink).run(cancel.clone()).await {
        Err(e @ outbox::RelayError::IdTaken { .. }) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(USAGE));
        }
        r => r?,
    };
    if !config.drain {
        return Ok(ExitCode::SUCCESS);
    }
    let mut retried = stats.retried;
    let mut quarantined = stats.quarantined;
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
        quarantined += stats.quarantined;
    }
    if retried > 0 {
        eprintln!(
            "drain finished, but {} (see the warnings above): {} still pending",
            if retried == 1 {
                "1 publish failed and was rescheduled".to_owned()
            } else {
                format!("{} publishes failed and were rescheduled", group(retried))
            },
            if retried == 1 {
                "that message is"
            } else {
                "those messages are"
            },
        );
        return Ok(ExitCode::from(DRAIN_RETRIED));
    }
    // Rows not due yet (delayed, or waiting for a retry an earlier run scheduled)
    // are not this run's failures, but a drain must not hide them.
    let pending = store.counts().await?.pending;
    if pending > 0 {
        eprintln!(
            "drain finished, with {} still pending: not due yet (delayed messages, retries scheduled earlier, rows parked behind dead letters), held behind an earlier row of their key (per-key ordering), of a paused topic, or written after the drain's last claim; `outbox status` shows them",
            counted(pending, "row"),
        );
        let paused = paused_topics(store.as_ref()).await?;
        if !paused.is_empty() {
            eprintln!(
                "topics paused (their rows stay pending until `outbox resume --topic PATTERN`): {}",
                paused.join(", ")
            );
        }
    }
    if quarantined > 0 {
        eprintln!(
            "drain finished, but {} quarantined as dead letters (see the warnings above; `outbox dead list` shows them, `outbox replay` sends them again)",
            if quarantined == 1 {
                "1 message was".to_owned()
            } else {
                format!(
                    "{} messages were",
                    group(i64::try_from(quarantined).unwrap_or(i64::MAX))
                )
            },
        );
    }
    if config.ordering.holds_dead() {
        let held = store.held_keys(&config.ordering).await?;
        if held.held > 0 {
            eprintln!(
                "{} of them {} behind the dead letters of {}: `outbox dead list --ordered …` marks them BLOCKS; `outbox replay` or `outbox dead discard` releases each key",
                group(held.held),
                if held.held == 1 { "waits" } else { "wait" },
                counted(held.blocked_keys, "ordered key")
            );
        }
    }
    if quarantined > 0 {
        return Ok(ExitCode::from(DRAIN_QUARANTINED));
    }
    Ok(ExitCode::SUCCESS)
}

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

/// A relay id of 1 to [`outbox::relay::MAX_RELAY_ID_BYTES`] bytes (what the stores'
/// `claimed_by` holds).
fn parse_relay_id(s: &str) -> Result<String, String> {
    let max = outbox::relay::MAX_RELAY_ID_BYTES;
    if s.is_empty() || s.len() > max {
        return Err(format!("a relay id must be 1-{max} bytes, got {}", s.len()));
    }
    Ok(s.to_owned())
}

/// The relay's sink: `sink` alone, or a router over `routes` with `sink` as the catch-all.
/// The JetStream streams of the routes to NATS: each route's pattern checked against
/// the server's streams, and with `create` a missing stream created
/// ([`outbox::sink::nats::NatsSink::ensure_stream`]). What is missing is said on stderr;
/// a server that cannot be asked within 10 s is said too and does not stop the relay
/// (it delivers once the server is back). A URL that cannot be read is the relay's
/// own error, given when it opens the routes.
async fn check_streams(routes: &[(String, String)], create: bool) {
    use outbox::sink::nats::{NatsSink, StreamCheck};
    for (pattern, url) in routes {
        if !(url.starts_with("nats://") || url.starts_with("tls://")) {
            continue;
        }
        let Ok(topics) = outbox::sink::router::TopicPattern::parse(pattern) else {
            continue;
        };
        let Ok(sink) = NatsSink::connect(url, Default::default()).await else {
            continue;
        };
        let shown = outbox::redact::redact_url(url);
        let checked =
            tokio::time::timeout(Duration::from_secs(10), sink.ensure_stream(&topics, create))
                .await;
        match checked {
            Ok(Ok(StreamCheck::Covered { .. })) => {}
            Ok(Ok(StreamCheck::Created { stream })) => eprintln!(
                "created JetStream stream {stream} (subjects {pattern:?}, file storage, 1 replica) on {shown}"
            ),
            Ok(Ok(StreamCheck::Missing {
                suggested,
                partial: Some(partial),
            })) => eprintln!(
                "warning: no JetStream stream on {shown} covers every topic of route {pattern:?}: stream {partial} covers part of it, so none was created; widen its subjects or split the route (messages no stream covers are quarantined; `outbox replay` sends them again; the name a new stream would get: {suggested})"
            ),
            Ok(Ok(StreamCheck::Missing { suggested, .. })) => eprintln!(
                "warning: no JetStream stream on {shown} covers route {pattern:?}: its messages will be quarantined until one does; run the relay once with --create-missing (creates stream {suggested}), or `nats stream add {suggested} --subjects '{pattern}' --storage file --replicas 1 --defaults`"
            ),
            Ok(Err(e)) => {
                eprintln!("warning: cannot check the JetStream streams of route {pattern:?}: {e}")
            }
            Err(_) => eprintln!(
                "warning: cannot check the JetStream streams of route {pattern:?}: {shown} did not answer within 10 s"
            ),
        }
        outbox::Sink::close(&sink).await;
    }
}

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
