//! Process setup before a command runs: log lines (and the relay's spans) and the
//! open-files limit.

/// Log lines on stderr, filtered by `OUTBOX_LOG`; with a tracer provider, also the
/// relay's spans to it (each layer with its own filter, so `OUTBOX_LOG` does not decide
/// which spans are exported).
pub(crate) fn init_logs(tracer: Option<&opentelemetry_sdk::trace::SdkTracerProvider>) {
    use tracing_subscriber::prelude::*;
    let filter = log_filter(std::env::var("OUTBOX_LOG").ok().as_deref());
    match tracer {
        None => tracing_subscriber::registry()
            .with(filter)
            .with(log_lines())
            .init(),
        Some(p) => tracing_subscriber::registry()
            .with(log_lines().with_filter(filter))
            .with(crate::otlp::layer(p))
            .init(),
    }
}

/// The log line layer: plain text on stderr, colours only on a terminal.
pub(crate) fn log_lines<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
}

/// The log filter when `OUTBOX_LOG` is unset or empty: the relay's own lines at info;
/// the libraries' are held to errors by [`QUIET_TARGETS`].
pub(crate) const DEFAULT_LOG: &str = "info";

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
pub(crate) const QUIET_TARGETS: [(&str, &str); 12] = [
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
pub(crate) fn log_filter_directives(user: Option<&str>) -> String {
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

pub(crate) fn log_filter(user: Option<&str>) -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_new(log_filter_directives(user)).unwrap_or_else(|e| {
        eprintln!("warning: OUTBOX_LOG is not a valid filter ({e}); using {DEFAULT_LOG:?}");
        tracing_subscriber::EnvFilter::new(log_filter_directives(None))
    })
}

/// Raises the soft limit on open files (`RLIMIT_NOFILE`) to the hard limit, as servers
/// do: the relay's store and broker connections, its file sinks and its HTTP listeners
/// (at most 256 connections each) then share the most descriptors the system allows this
/// process. Best effort: a refusal is logged at debug and the process goes on.
pub(crate) fn raise_open_files_limit() {
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

#[cfg(test)]
mod tests {
    use super::log_filter_directives;

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
