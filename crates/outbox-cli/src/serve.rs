//! The relay's HTTP listener (`--metrics-addr`): `/metrics` (Prometheus text format),
//! `/healthz` (the process is up) and `/readyz` (the store is reachable and migrated, and
//! the relay loop turned within two poll intervals). The admin server (`dashboard`) serves
//! the same three routes beside the dashboard, from the pieces here.

use anyhow::Context as _;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use outbox::relay::RelayHealth;
use outbox::store::Store;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Histogram buckets (seconds) for the latency histograms: 0.5 ms … 1 h, so both the
/// millisecond path (claim, settle, confirm) and a backlog's enqueue-to-confirm fit.
const SECONDS_BUCKETS: [f64; 20] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0, 900.0, 1800.0, 3600.0,
];

/// Buckets (messages) for `outbox_batch_size`.
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0];

/// What `/readyz` looks at: the store, and the running relay's health (replaced when a
/// drain runs the relay again).
pub(crate) struct Ready {
    pub(crate) store: Arc<dyn Store>,
    /// SQLite: the database file, which must still exist (a file deleted under a running
    /// relay leaves its open connections working on the deleted inode).
    pub(crate) sqlite_file: Option<std::path::PathBuf>,
    pub(crate) relay: RwLock<Option<Arc<RelayHealth>>>,
    /// The running relay's router (its destinations and their state), for the dashboard.
    pub(crate) router: RwLock<Option<Arc<outbox::sink::router::Router>>>,
    /// True in a process that runs a relay: `/readyz` then also needs its loop turning
    /// (`outbox serve` alone needs only the store).
    pub(crate) runs_relay: bool,
}

impl Ready {
    /// What `/readyz` reads, for `store` (`sqlite_file`: the SQLite database file).
    pub(crate) fn new(
        store: Arc<dyn Store>,
        sqlite_file: Option<std::path::PathBuf>,
        runs_relay: bool,
    ) -> Self {
        Ready {
            store,
            sqlite_file,
            relay: RwLock::new(None),
            router: RwLock::new(None),
            runs_relay,
        }
    }
}

/// Installs the Prometheus recorder (histogram buckets, and gauges dropped when not set for
/// a minute, so a relay that stopped sampling the store stops exporting old values),
/// describes every metric and keeps the recorder's upkeep running. Once per process: the
/// metrics listener and the admin server share the handle.
///
/// # Errors
/// A recorder is installed already.
pub(crate) fn recorder() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)?
        .set_buckets_for_metric(
            Matcher::Full(outbox::metrics::BATCH_SIZE.into()),
            &BATCH_BUCKETS,
        )?
        .idle_timeout(
            metrics_util::MetricKindMask::GAUGE,
            Some(Duration::from_secs(60)),
        )
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    outbox::metrics::describe();
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// `addr` as a socket address; `flag` names the option in the error.
///
/// # Errors
/// Not HOST:PORT with an IP address.
pub(crate) fn parse_addr(flag: &str, addr: &str) -> anyhow::Result<std::net::SocketAddr> {
    addr.parse().map_err(|e| {
        anyhow::anyhow!("{flag} {addr:?} is not HOST:PORT with an IP address and a port (e.g. 127.0.0.1:9464): {e}")
    })
}

/// Binds `addr` (`flag` names the option in the error: a clear one when it is taken).
///
/// # Errors
/// The address cannot be bound.
pub(crate) async fn bind(
    flag: &str,
    addr: std::net::SocketAddr,
) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("{flag} {addr}: cannot listen there"))
}

/// The routes `/metrics`, `/healthz` and `/readyz`.
pub(crate) fn probes(handle: PrometheusHandle, ready: Arc<Ready>) -> Router {
    Router::new()
        .route("/metrics", get(metrics).with_state(handle))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz).with_state(ready))
}

/// Serves `app` on `listener` until `cancel` (in a task of its own; `what` names the
/// server in the error log).
pub(crate) fn spawn(
    listener: tokio::net::TcpListener,
    app: Router,
    cancel: CancellationToken,
    what: &'static str,
) {
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "the {what} stopped");
        }
    });
}

/// Binds `addr` (`--metrics-addr`) and serves `/metrics`, `/healthz` and `/readyz` until
/// `cancel`.
///
/// # Errors
/// The address cannot be bound.
pub(crate) async fn start(
    addr: &str,
    handle: PrometheusHandle,
    ready: Arc<Ready>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let listener = bind("--metrics-addr", parse_addr("--metrics-addr", addr)?).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    spawn(listener, probes(handle, ready), cancel, "metrics listener");
    Ok(())
}

async fn metrics(State(handle): State<PrometheusHandle>) -> String {
    handle.render()
}

async fn readyz(State(ready): State<Arc<Ready>>) -> (StatusCode, String) {
    if let Some(f) = &ready.sqlite_file
        && !f.exists()
    {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "store: the database file {} no longer exists\n",
                f.display()
            ),
        );
    }
    match tokio::time::timeout(Duration::from_secs(2), ready.store.check_schema()).await {
        Err(_) => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "store: no answer within 2 s\n".into(),
            );
        }
        Ok(Err(e)) => return (StatusCode::SERVICE_UNAVAILABLE, format!("store: {e}\n")),
        Ok(Ok(())) => {}
    }
    let health = ready
        .relay
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    match health {
        Some(h) if h.is_alive() => (StatusCode::OK, "ready\n".into()),
        Some(h) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "relay loop: last turn {:.1} s ago\n",
                h.since_last_turn().as_secs_f64()
            ),
        ),
        None if !ready.runs_relay => (StatusCode::OK, "ready\n".into()),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "relay loop: not started\n".into(),
        ),
    }
}
