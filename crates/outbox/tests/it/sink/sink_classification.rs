//! Error classification against the real brokers (the user guide's "Error classification
//! per sink", `docs/guide/src/error-classification.md`): the sinks are called directly and each outcome's kind is checked.
//!
//! - NATS without JetStream (a private `nats-server` without `-js`): every message is
//!   unavailable (the destination is missing), never transient.
//! - A JetStream stream with `max_msg_size`: a message over it is permanent (10054), one
//!   under it on the same stream succeeds; a full stream with `discard: new` is
//!   unavailable (10077); a message whose `Nats-Expected-Stream` header names another
//!   stream is permanent (10060).
//! - HTTP `429` and `503` are unavailable with `retry_after` from `Retry-After` (seconds,
//!   and an HTTP-date measured against the response's own `Date`, so a server clock a day
//!   off does not matter); `500` stays transient.
//! - The webhook's request timeout comes from the URL (`outbox_timeout_ms`), and that
//!   parameter is not sent to the endpoint.

#![allow(clippy::unwrap_used)]

use async_nats::jetstream::stream::{Config as StreamConfig, DiscardPolicy, StorageType};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::IntoResponse;
use chrono::Utc;
use outbox::message::OutgoingMessage;
use outbox::sink::nats::{NatsOptions, NatsSink};
use outbox::sink::{ErrorKind, PublishError, Sink};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Publishes `batch` and returns one outcome per message (the one place that knows how
/// `Sink::publish` is called).
async fn publish_all(sink: &dyn Sink, batch: &[OutgoingMessage]) -> Vec<Result<(), PublishError>> {
    sink.publish_all(batch).await
}

fn outgoing(topic: &str, payload: Vec<u8>) -> OutgoingMessage {
    crate::sink::publisher_conformance::outgoing(1, topic, None, payload)
}

fn unique() -> String {
    Uuid::new_v4().simple().to_string()[..12].to_owned()
}

fn kind_of(r: &Result<(), PublishError>) -> Option<ErrorKind> {
    r.as_ref().err().map(|e| e.kind)
}

// ---------------------------------------------------------------------------------------
// NATS
// ---------------------------------------------------------------------------------------

fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A private `nats-server` on a free port, killed on drop.
struct PrivateNats {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl PrivateNats {
    async fn start(args: &[&str]) -> Self {
        let bin = std::env::var("OUTBOX_TEST_NATS_SERVER")
            .unwrap_or_else(|_| "/usr/sbin/nats-server".into());
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(&bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {bin}: {e} (install nats-server)"));
        crate::common::wait_listening("the private nats-server", port, Duration::from_secs(10))
            .await;
        PrivateNats {
            child,
            port,
            _dir: dir,
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn nats_sink(url: &str) -> NatsSink {
    NatsSink::connect(
        url,
        NatsOptions {
            ack_timeout: Duration::from_secs(2),
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_without_jetstream_is_unavailable_not_transient() {
    let server = PrivateNats::start(&[]).await;
    let sink = nats_sink(&server.url()).await;
    let batch: Vec<_> = (0..3)
        .map(|i| outgoing(&format!("orders.o{i}"), b"x".to_vec()))
        .collect();
    let out = publish_all(&sink, &batch).await;
    assert_eq!(out.len(), 3);
    for r in &out {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
        assert!(e.message.contains("JetStream is not available"), "{e}");
    }
}

/// A stream of its own on the shared JetStream server, deleted on drop.
struct Stream {
    js: async_nats::jetstream::Context,
    name: String,
    prefix: String,
}

impl Stream {
    async fn create(configure: impl FnOnce(&mut StreamConfig)) -> Self {
        let client = async_nats::connect(nats_url())
            .await
            .expect("NATS with JetStream must listen on 127.0.0.1:4222");
        let js = async_nats::jetstream::new(client);
        let id = unique();
        let name = format!("CLASSIFY_{}", id.to_uppercase());
        let prefix = format!("classify{id}");
        let mut config = StreamConfig {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            storage: StorageType::Memory,
            ..Default::default()
        };
        configure(&mut config);
        js.create_stream(config).await.unwrap();
        Stream { js, name, prefix }
    }

    fn subject(&self, rest: &str) -> String {
        format!("{}.{rest}", self.prefix)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let js = self.js.clone();
        let name = self.name.clone();
        // Best effort; the test runtime may be gone already.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = js.delete_stream(&name).await;
            });
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_stream_max_msg_size_is_permanent_for_that_message_only() {
    let stream = Stream::create(|c| c.max_message_size = 1024).await;
    let sink = nats_sink(&nats_url()).await;
    let batch = vec![
        outgoing(&stream.subject("small"), vec![b'a'; 100]),
        outgoing(&stream.subject("big"), vec![b'b'; 4096]),
        outgoing(&stream.subject("small"), vec![b'c'; 200]),
    ];
    let out = publish_all(&sink, &batch).await;
    assert!(out[0].is_ok(), "{:?}", out[0]);
    let e = out[1].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Permanent, "{e}");
    assert!(e.message.contains("10054"), "{e}");
    assert!(out[2].is_ok(), "{:?}", out[2]);
    let _ = stream.js.delete_stream(&stream.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_full_stream_with_discard_new_is_unavailable() {
    let stream = Stream::create(|c| {
        c.max_messages = 1;
        c.discard = DiscardPolicy::New;
    })
    .await;
    let sink = nats_sink(&nats_url()).await;
    let first = publish_all(&sink, &[outgoing(&stream.subject("a"), b"1".to_vec())]).await;
    assert!(first[0].is_ok(), "{:?}", first[0]);
    let second = publish_all(&sink, &[outgoing(&stream.subject("a"), b"2".to_vec())]).await;
    let e = second[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    assert!(e.message.contains("10077"), "{e}");
    let _ = stream.js.delete_stream(&stream.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_expected_stream_header_mismatch_is_permanent() {
    let stream = Stream::create(|_| {}).await;
    let sink = nats_sink(&nats_url()).await;
    let mut m = outgoing(&stream.subject("a"), b"1".to_vec());
    m.headers
        .insert("Nats-Expected-Stream".into(), "SOME_OTHER_STREAM".into());
    let out = publish_all(&sink, &[m, outgoing(&stream.subject("b"), b"2".to_vec())]).await;
    let e = out[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Permanent, "{e}");
    assert!(e.message.contains("10060"), "{e}");
    assert!(out[1].is_ok(), "{:?}", out[1]);
    let _ = stream.js.delete_stream(&stream.name).await;
}

// ---------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------

/// What the endpoint answers: status and headers; it records each request's URI.
#[derive(Clone)]
struct Endpoint {
    status: u16,
    headers: Vec<(&'static str, String)>,
    delay: Duration,
    uris: Arc<Mutex<Vec<String>>>,
}

impl Endpoint {
    fn new(status: u16) -> Self {
        Endpoint {
            status,
            headers: Vec::new(),
            delay: Duration::ZERO,
            uris: Arc::default(),
        }
    }

    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    /// Serves until the test ends; returns the endpoint URL.
    async fn serve(&self) -> String {
        let me = self.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, _h: HeaderMap| {
            let me = me.clone();
            async move {
                me.uris.lock().unwrap().push(uri.to_string());
                tokio::time::sleep(me.delay).await;
                let mut resp = StatusCode::from_u16(me.status).unwrap().into_response();
                for (n, v) in &me.headers {
                    resp.headers_mut().insert(*n, v.parse().unwrap());
                }
                resp
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        format!("http://{addr}/hooks/in")
    }
}

async fn webhook(url: &str) -> outbox::sink::http::WebhookSink {
    outbox::sink::http::WebhookSink::connect_with(
        url,
        outbox::sink::http::WebhookOptions::default(),
    )
    .await
    .unwrap()
}

fn http_date(t: chrono::DateTime<Utc>) -> String {
    t.format("%a, %d %b %Y %H:%M:%S GMT").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_429_and_503_are_destination_pressure_with_retry_after() {
    let too_many = Endpoint::new(429).header("retry-after", "7").serve().await;
    let out = publish_all(&webhook(&too_many).await, &[outgoing("t", b"x".to_vec())]).await;
    let e = out[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    assert_eq!(e.retry_after, Some(Duration::from_secs(7)), "{e}");

    let overloaded = Endpoint::new(503).serve().await;
    let out = publish_all(&webhook(&overloaded).await, &[outgoing("t", b"x".to_vec())]).await;
    let e = out[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    assert_eq!(e.retry_after, None, "{e}");

    let failing = Endpoint::new(500).header("retry-after", "3").serve().await;
    let out = publish_all(&webhook(&failing).await, &[outgoing("t", b"x".to_vec())]).await;
    assert_eq!(kind_of(&out[0]), Some(ErrorKind::Transient));
    assert_eq!(
        out[0].as_ref().unwrap_err().retry_after,
        Some(Duration::from_secs(3))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_retry_after_date_is_measured_against_the_servers_date_header() {
    // The server's clock is a day behind ours: its Retry-After date is a day in our past,
    // yet it asks for 90 s after its own Date.
    let server_now = Utc::now() - chrono::Duration::days(1);
    let endpoint = Endpoint::new(503)
        .header("date", http_date(server_now))
        .header(
            "retry-after",
            http_date(server_now + chrono::Duration::seconds(90)),
        )
        .serve()
        .await;
    let out = publish_all(&webhook(&endpoint).await, &[outgoing("t", b"x".to_vec())]).await;
    let e = out[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    assert_eq!(e.retry_after, Some(Duration::from_secs(90)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_request_timeout_comes_from_the_url_and_is_not_sent() {
    let mut slow = Endpoint::new(200);
    slow.delay = Duration::from_secs(3);
    let url = slow.serve().await;
    let sink = webhook(&format!("{url}?a=1&outbox_timeout_ms=300")).await;
    let start = Instant::now();
    let out = publish_all(&sink, &[outgoing("t", b"x".to_vec())]).await;
    let took = start.elapsed();
    let e = out[0].as_ref().unwrap_err();
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert!(e.message.contains("300ms"), "{e}");
    let uris = slow.uris.lock().unwrap().clone();
    assert_eq!(uris, vec!["/hooks/in?a=1".to_owned()]);
    assert!(
        outbox::sink::http::WebhookSink::connect_with(
            &format!("{url}?outbox_timeout_ms=soon"),
            outbox::sink::http::WebhookOptions::default()
        )
        .await
        .is_err()
    );
}
