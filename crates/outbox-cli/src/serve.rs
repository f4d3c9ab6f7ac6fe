//! The relay's HTTP listener (`--metrics-addr`): `/metrics` (Prometheus text format),
//! `/healthz` (the process is up) and `/readyz` (the store is reachable and migrated, and
//! the relay loop turned within two poll intervals).

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
}

/// Installs the Prometheus recorder (histogram buckets, and gauges dropped when not set for
/// a minute, so a relay that stopped sampling the store stops exporting old values),
/// describes every metric, binds `addr` (a clear error when it is taken) and serves until
/// `cancel`.
///
/// # Errors
/// The address cannot be bound, or a recorder is installed already.
pub(crate) async fn start(
    addr: &str,
    ready: Arc<Ready>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let parsed: std::net::SocketAddr = addr.parse().map_err(|e| {
        anyhow::anyhow!("--metrics-addr {addr:?} is not HOST:PORT with an IP address and a port (e.g. 127.0.0.1:9464): {e}")
    })?;
    let listener = tokio::net::TcpListener::bind(parsed)
        .await
        .with_context(|| format!("--metrics-addr {addr}: cannot listen there"))?;
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
    let app = Router::new()
        .route("/metrics", get(metrics).with_state(handle))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz).with_state(ready));
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "the metrics listener stopped");
        }
    });
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
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "relay loop: not started\n".into(),
        ),
    }
}
