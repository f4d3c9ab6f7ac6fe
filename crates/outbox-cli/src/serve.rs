//! The relay's HTTP listener (`--metrics-addr`): `/metrics` (Prometheus text format),
//! `/healthz` (the process is up) and `/readyz` (the store is reachable and migrated, and
//! the relay loop turned within two poll intervals). The admin server (`dashboard`) serves
//! the same three routes beside the dashboard, from the pieces here.
//!
//! Both listeners bound what a client can hold ([`ListenerLimits`]): at most
//! [`MAX_CONNECTIONS`] open connections each (beyond it the listener stops accepting until
//! one closes), a header-read timeout that also closes idle keep-alive connections, a
//! time limit on each request (its body included), and a write timeout: a connection whose
//! answers make no progress towards the client for [`WRITE_TIMEOUT`] is closed, so a client
//! that pipelines requests and never reads the answers holds no connection for long. With the connection limits well below
//! the process's file descriptors (raised to the hard limit at start), a client that
//! opens connections and holds them cannot take the descriptors the relay's own store and
//! broker connections need.

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
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Most connections one listener holds open at a time. Beyond it the listener stops
/// accepting (new connections wait in the kernel's backlog) until one closes. Two
/// listeners at most hold 512 descriptors, well below the file-descriptor limit the
/// process raises itself to at start; where that limit is low, each listener holds at
/// most a quarter of it ([`connection_limit`]).
pub(crate) const MAX_CONNECTIONS: usize = 256;

/// The connection limit of one listener when the process may open `open_files`
/// descriptors: [`MAX_CONNECTIONS`], or a quarter of `open_files` when that is less (at
/// least 8), so two listeners leave the relay at least half its descriptors.
pub(crate) fn connection_limit(open_files: Option<u64>) -> usize {
    let quarter = open_files.map_or(MAX_CONNECTIONS, |n| {
        usize::try_from(n / 4).unwrap_or(MAX_CONNECTIONS)
    });
    quarter.clamp(8, MAX_CONNECTIONS)
}

/// The process's soft limit on open files (`RLIMIT_NOFILE`), when it can be read.
fn open_files_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into `limit`, a valid rlimit owned here.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } == 0 {
            // rlim_t is narrower than u64 on some targets.
            #[allow(clippy::useless_conversion)]
            return Some(u64::from(limit.rlim_cur));
        }
    }
    None
}

/// How long a client has to send a request's headers, and how long an idle keep-alive
/// connection stays open, unless `OUTBOX_HTTP_HEADER_TIMEOUT` says otherwise.
pub(crate) const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long writing to a connection may make no progress (the client reads none of what
/// was sent) before the connection is closed, unless `OUTBOX_HTTP_WRITE_TIMEOUT` says
/// otherwise.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The send buffer of each accepted connection (bytes; Linux reserves twice this). Fixed,
/// so the kernel does not grow it (up to 4 MiB) for a client that reads nothing: its
/// answers stop leaving, and the write timeout closes the connection, within this much.
pub(crate) const SEND_BUFFER: usize = 256 * 1024;

/// How long one request may take, reading its body and answering included (408 after):
/// 5 minutes, room for a large replay; a client that sends a body slowly frees its
/// connection then at the latest.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// What one HTTP listener allows a client.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListenerLimits {
    /// Most open connections ([`connection_limit`]).
    pub(crate) max_connections: usize,
    /// Time to send a request's headers; also the longest a keep-alive connection stays
    /// idle between requests ([`HEADER_TIMEOUT`], `OUTBOX_HTTP_HEADER_TIMEOUT`).
    pub(crate) header_timeout: Duration,
    /// Time for a whole request, its body read and its answer made ([`REQUEST_TIMEOUT`]).
    pub(crate) request_timeout: Duration,
    /// Longest a write to the client may make no progress before the connection is closed
    /// ([`WRITE_TIMEOUT`], `OUTBOX_HTTP_WRITE_TIMEOUT`).
    pub(crate) write_timeout: Duration,
}

impl ListenerLimits {
    /// The defaults: the connection limit for this process's open-files limit, the
    /// header-read timeout from `OUTBOX_HTTP_HEADER_TIMEOUT` and the write timeout from
    /// `OUTBOX_HTTP_WRITE_TIMEOUT` when set (a duration: `500ms`, `10s`, `1m`).
    ///
    /// # Errors
    /// `OUTBOX_HTTP_HEADER_TIMEOUT` or `OUTBOX_HTTP_WRITE_TIMEOUT` is not a duration, is
    /// zero or is over an hour.
    pub(crate) fn from_env() -> anyhow::Result<Self> {
        Ok(ListenerLimits {
            max_connections: connection_limit(open_files_limit()),
            header_timeout: duration_env("OUTBOX_HTTP_HEADER_TIMEOUT", HEADER_TIMEOUT)?,
            request_timeout: REQUEST_TIMEOUT,
            write_timeout: duration_env("OUTBOX_HTTP_WRITE_TIMEOUT", WRITE_TIMEOUT)?,
        })
    }
}

/// The duration in the environment variable `name`, or `default` when it is unset or
/// empty.
///
/// # Errors
/// Not a duration, zero or over an hour.
fn duration_env(name: &str, default: Duration) -> anyhow::Result<Duration> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => {
            let d = humantime::parse_duration(v.trim()).map_err(|e| {
                anyhow::anyhow!("{name} {v:?} is not a duration (500ms, 10s, 1m): {e}")
            })?;
            anyhow::ensure!(
                !d.is_zero() && d <= Duration::from_secs(3600),
                "{name} {v:?} must be more than 0 and at most 1h"
            );
            Ok(d)
        }
        _ => Ok(default),
    }
}

/// A connection's stream whose writes (and flushes) fail with
/// [`std::io::ErrorKind::TimedOut`] once they have made no progress for `timeout`: a
/// timer starts when a write cannot go on (the client's window and the socket's send
/// buffer are full) and stops at the next write that goes through. A flush that returns
/// at once is no progress (a TCP stream's flush does nothing): it leaves the timer running.
struct WriteTimeout<S> {
    inner: S,
    timeout: Duration,
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S> WriteTimeout<S> {
    fn new(inner: S, timeout: Duration) -> Self {
        WriteTimeout {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// `polled` (the outcome of a write, or of a flush or shutdown when `wrote` is false)
    /// as is when ready, a write stopping the timer; when pending, pending until the timer
    /// armed at the first pending call fires, then `TimedOut`.
    fn progress<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        polled: std::task::Poll<std::io::Result<T>>,
        wrote: bool,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::future::Future as _;
        use std::task::Poll;
        if polled.is_ready() {
            if wrote {
                self.stalled = None;
            }
            return polled;
        }
        let timeout = self.timeout;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.stalled = None;
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the client read nothing for {timeout:?}"),
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteTimeout<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteTimeout<S> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        this.progress(cx, polled, true)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.progress(cx, polled, true)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_flush(cx);
        this.progress(cx, polled, false)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_shutdown(cx);
        this.progress(cx, polled, false)
    }
}

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
/// server in the logs), within `limits`: HTTP/1.1, a connection at a time per task, at most
/// `limits.max_connections` of them; headers not read within `limits.header_timeout` close
/// the connection, a request not answered within `limits.request_timeout` gets 408, a
/// connection whose answers make no progress for `limits.write_timeout` is closed.
pub(crate) fn spawn(
    listener: tokio::net::TcpListener,
    app: Router,
    cancel: CancellationToken,
    what: &'static str,
    limits: ListenerLimits,
) {
    tokio::spawn(async move {
        let slots = Arc::new(Semaphore::new(limits.max_connections));
        let mut full_logged = false;
        loop {
            // A free slot first: at the limit, connections wait in the backlog.
            let slot = match slots.clone().try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => {
                    if !full_logged {
                        tracing::warn!(
                            limit = limits.max_connections,
                            "the {what} holds its most connections: new ones wait until one closes"
                        );
                        full_logged = true;
                    }
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        slot = slots.clone().acquire_owned() => match slot {
                            Ok(slot) => slot,
                            Err(_) => return,
                        },
                    }
                }
            };
            let stream = tokio::select! {
                () = cancel.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors (EMFILE) and the like: retry shortly
                        // rather than spin.
                        tracing::warn!(error = %e, "the {what} cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            if slots.available_permits() > limits.max_connections / 2 {
                full_logged = false;
            }
            tokio::spawn(connection(
                stream,
                app.clone(),
                cancel.clone(),
                limits,
                slot,
            ));
        }
    });
}

/// Serves one connection until it closes, its headers or a write time out or `cancel` (then it
/// finishes the request in hand); `_slot` is its place under the connection limit.
async fn connection(
    stream: tokio::net::TcpStream,
    app: Router,
    cancel: CancellationToken,
    limits: ListenerLimits,
    _slot: tokio::sync::OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let _ = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER);
    let service =
        hyper::service::service_fn(move |req: axum::extract::Request<hyper::body::Incoming>| {
            let call = tower::ServiceExt::oneshot(app.clone(), req);
            async move {
                Ok::<_, std::convert::Infallible>(
                    match tokio::time::timeout(limits.request_timeout, call).await {
                        Ok(Ok(response)) => response,
                        Ok(Err(never)) => match never {},
                        Err(_) => {
                            let mut r = axum::response::IntoResponse::into_response((
                                StatusCode::REQUEST_TIMEOUT,
                                "request not complete in time\n",
                            ));
                            r.headers_mut().insert(
                                axum::http::header::CONNECTION,
                                axum::http::HeaderValue::from_static("close"),
                            );
                            r
                        }
                    },
                )
            }
        });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let stream = WriteTimeout::new(stream, limits.write_timeout);
    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    let served = tokio::select! {
        served = conn.as_mut() => served,
        () = cancel.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = served {
        // A client that went away or timed out: its own business.
        tracing::debug!(error = %e, "HTTP connection closed");
    }
}

/// Binds `addr` (`--metrics-addr`) and serves `/metrics`, `/healthz` and `/readyz` until
/// `cancel`, within [`ListenerLimits::from_env`].
///
/// # Errors
/// A bad `OUTBOX_HTTP_HEADER_TIMEOUT` or `OUTBOX_HTTP_WRITE_TIMEOUT`; the address cannot
/// be bound.
pub(crate) async fn start(
    addr: &str,
    handle: PrometheusHandle,
    ready: Arc<Ready>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let limits = ListenerLimits::from_env()?;
    let listener = bind("--metrics-addr", parse_addr("--metrics-addr", addr)?).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    spawn(
        listener,
        probes(handle, ready),
        cancel,
        "metrics listener",
        limits,
    );
    Ok(())
}

/// The scrape, not to be kept by a browser or a proxy (`Cache-Control: no-store`).
async fn metrics(
    State(handle): State<PrometheusHandle>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    (
        [(axum::http::header::CACHE_CONTROL, "no-store")],
        handle.render(),
    )
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_limit_leaves_the_relay_half_its_descriptors() {
        assert_eq!(connection_limit(None), 256);
        assert_eq!(connection_limit(Some(1_048_576)), 256);
        assert_eq!(connection_limit(Some(1024)), 256);
        assert_eq!(connection_limit(Some(512)), 128);
        assert_eq!(connection_limit(Some(16)), 8);
        assert_eq!(connection_limit(Some(u64::MAX)), 256);
    }
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;

    /// At its connection limit a listener accepts no more until one closes; a connection
    /// that sends no headers is closed after the header-read timeout.
    #[tokio::test]
    async fn connections_are_limited_and_half_requests_time_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/healthz", get(|| async { "ok\n" }));
        let cancel = CancellationToken::new();
        let limits = ListenerLimits {
            max_connections: 2,
            header_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
        };
        spawn(
            listener,
            app.clone(),
            cancel.clone(),
            "test listener",
            limits,
        );
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /healthz HTT").await.unwrap();
            held.push(s);
        }
        let mut third = TcpStream::connect(addr).await.unwrap();
        third
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        assert!(
            tokio::time::timeout(Duration::from_millis(300), third.read_to_end(&mut answer))
                .await
                .is_err(),
            "answered beyond the limit: {:?}",
            String::from_utf8_lossy(&answer)
        );
        drop(held.pop());
        tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut answer))
            .await
            .unwrap()
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("ok\n"), "{answer}");
        cancel.cancel();

        // A short header-read timeout closes a half-sent request.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let limits = ListenerLimits {
            header_timeout: Duration::from_millis(200),
            ..limits
        };
        spawn(listener, app, cancel.clone(), "test listener", limits);
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTT").await.unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "still open after the header-read timeout");
        cancel.cancel();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod write_timeout_tests {
    use super::WriteTimeout;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A write that makes no progress fails with `TimedOut` after the timeout, counted
    /// from when it stalled; a read on the other side between stalls restarts the count.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_write_times_out_and_progress_restarts_the_timer() {
        let (near, mut far) = tokio::io::duplex(16);
        let mut near = WriteTimeout::new(near, Duration::from_secs(10));
        near.write_all(&[1; 16]).await.unwrap();
        let started = tokio::time::Instant::now();
        // Stalled for 6 s, then the far side reads: progress, the write completes.
        let reader = async {
            tokio::time::sleep(Duration::from_secs(6)).await;
            let mut buf = [0u8; 16];
            far.read_exact(&mut buf).await.unwrap();
            far
        };
        let (written, mut far) = tokio::join!(near.write_all(&[2; 16]), reader);
        written.unwrap();
        assert_eq!(started.elapsed(), Duration::from_secs(6));
        // Stalled again: 10 s from now, not from the first stall.
        let stalled = tokio::time::Instant::now();
        let e = near.write_all(&[3; 1]).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(stalled.elapsed(), Duration::from_secs(10));
        let mut buf = [0u8; 16];
        far.read_exact(&mut buf).await.unwrap();
        assert_eq!(buf, [2; 16]);
    }
}
