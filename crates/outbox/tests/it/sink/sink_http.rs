//! The webhook sink against a real HTTP server started inside each test (axum on
//! 127.0.0.1:0) that records every request and answers as the test says: payload bytes and
//! envelope headers arrive intact (binary, empty, 1 MiB, non-ASCII header values
//! percent-encoded), status codes map to ok / transient / unavailable (429 and 503, with
//! `Retry-After`) / permanent,
//! a closed port is unavailable, Standard Webhooks signatures verify, and through the relay
//! (SQLite): 200 messages delivered, a 503 + `Retry-After: 2` retried no sooner than 2 s
//! later, a 400 quarantined after one attempt.

#![allow(clippy::unwrap_used)]

use crate::common::{relay_config, wait_until};
use crate::sink::publisher_conformance::http::percent_decode;
use crate::store::conformance::Backend as _;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt as _;
use base64::Engine as _;
use chrono::Utc;
use hmac::{Hmac, Mac};
use outbox::Relay;
use outbox::message::OutgoingMessage;
use outbox::sink::http::{WebhookOptions, WebhookSecret, WebhookSink};
use outbox::sink::{ErrorKind, Sink};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------
// A recording HTTP server
// ---------------------------------------------------------------------------------------

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub(crate) struct Recorded {
    pub(crate) at: Instant,
    uri: String,
    headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Recorded {
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8(v.as_bytes().to_vec()).unwrap())
    }

    fn key(&self) -> String {
        self.header("idempotency-key").unwrap()
    }
}

/// What the server answers.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
    delay: Duration,
}

impl Reply {
    pub(crate) fn status(status: u16) -> Self {
        Reply {
            status,
            headers: Vec::new(),
            body: String::new(),
            delay: Duration::ZERO,
        }
    }

    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    fn body(mut self, body: impl Into<String>) -> Self {
        self.body = body.into();
        self
    }

    /// Answers after `delay`.
    pub(crate) fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// Decides the reply from the request and how many earlier requests carried its
/// idempotency key.
type Responder = Arc<dyn Fn(&Recorded, usize) -> Reply + Send + Sync>;

struct ServerState {
    /// False for measurements: nothing is recorded (the per-key count is O(requests)).
    record: bool,
    requests: Mutex<Vec<Recorded>>,
    responder: Responder,
}

pub(crate) struct TestServer {
    pub(crate) url: String,
    state: Arc<ServerState>,
    task: tokio::task::JoinHandle<()>,
}

impl TestServer {
    pub(crate) async fn start(
        responder: impl Fn(&Recorded, usize) -> Reply + Send + Sync + 'static,
    ) -> Self {
        Self::start_with(true, responder).await
    }

    async fn start_with(
        record: bool,
        responder: impl Fn(&Recorded, usize) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let state = Arc::new(ServerState {
            record,
            requests: Mutex::new(Vec::new()),
            responder: Arc::new(responder),
        });
        let app = Router::new()
            .fallback(handle)
            .layer(DefaultBodyLimit::disable())
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // No Nagle delay on the server's writes (a response's head and body go out
        // separately and would wait for the client's delayed ACK).
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        TestServer {
            url: format!("http://{addr}/hooks/in"),
            state,
            task,
        }
    }

    /// A server answering 200 to everything.
    async fn ok() -> Self {
        Self::start(|_, _| Reply::status(200)).await
    }

    pub(crate) fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().unwrap().clone()
    }

    fn by_key(&self) -> HashMap<String, Vec<Recorded>> {
        let mut map: HashMap<String, Vec<Recorded>> = HashMap::new();
        for r in self.requests() {
            map.entry(r.key()).or_default().push(r);
        }
        map
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    State(s): State<Arc<ServerState>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let rec = Recorded {
        at: Instant::now(),
        uri: uri.to_string(),
        headers,
        body,
    };
    let earlier = if !s.record {
        0
    } else {
        let mut reqs = s.requests.lock().unwrap();
        let key = rec.header("idempotency-key");
        let n = reqs
            .iter()
            .filter(|r| r.header("idempotency-key") == key)
            .count();
        reqs.push(rec.clone());
        n
    };
    let reply = (s.responder)(&rec, earlier);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    let mut resp = (StatusCode::from_u16(reply.status).unwrap(), reply.body).into_response();
    for (n, v) in reply.headers {
        resp.headers_mut().insert(n, v.parse().unwrap());
    }
    resp
}

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn outgoing(topic: &str, payload: Vec<u8>) -> OutgoingMessage {
    crate::sink::publisher_conformance::outgoing(1, topic, None, payload)
}

fn with_header(mut m: OutgoingMessage, name: &str, value: &str) -> OutgoingMessage {
    m.headers.insert(name.to_owned(), value.to_owned());
    m
}

pub(crate) async fn webhook(url: &str) -> WebhookSink {
    WebhookSink::connect_with(url, WebhookOptions::default())
        .await
        .unwrap()
}

// ---------------------------------------------------------------------------------------
// The sink alone
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn payload_bytes_and_envelope_headers_arrive_intact() {
    let server = TestServer::ok().await;
    let sink = webhook(&server.url).await;

    let binary: Vec<u8> = (0..=255u8).chain([0, 0xff, 0xfe, 0x00]).collect();
    let big: Vec<u8> = (0..1024 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    let mut a = outgoing("orders.order-placed.v1", binary.clone());
    a.key = Some("order-42".into());
    let a = with_header(
        with_header(
            with_header(a, "correlation-id", "req-7"),
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        "tenant",
        "Grüße, Zoë ✓ 東京",
    );
    let b = with_header(
        with_header(
            outgoing("orders.empty.v1", Vec::new()),
            "note",
            " 100% sure ",
        ),
        "content-type",
        "application/json; charset=utf-8",
    );
    let c = outgoing("orders.big.v1", big.clone());
    let batch = vec![a.clone(), b.clone(), c.clone()];

    let results = sink.publish_all(&batch).await;
    assert_eq!(results, vec![Ok(()), Ok(()), Ok(())]);

    let reqs = server.by_key();
    assert_eq!(reqs.len(), 3, "one request per message");
    for m in &batch {
        let r = &reqs[&m.message_id.to_string()];
        assert_eq!(r.len(), 1);
        let r = &r[0];
        assert_eq!(
            r.body.as_ref(),
            m.payload.as_ref(),
            "payload bytes of {}",
            m.topic
        );
        assert_eq!(r.header("message-id").unwrap(), m.message_id.to_string());
        assert_eq!(r.header("topic").unwrap(), m.topic);
        assert_eq!(r.header("key"), m.key.clone());
        let occurred =
            chrono::DateTime::parse_from_rfc3339(&r.header("occurred-at").unwrap()).unwrap();
        assert_eq!(
            occurred.timestamp_micros(),
            m.occurred_at.timestamp_micros()
        );
        // No secret configured: no signature headers.
        assert!(r.header("webhook-signature").is_none());
    }
    let ra = &reqs[&a.message_id.to_string()][0];
    assert_eq!(
        ra.header("content-type").unwrap(),
        "application/octet-stream"
    );
    assert_eq!(ra.header("correlation-id").unwrap(), "req-7");
    assert_eq!(
        ra.header("traceparent").unwrap(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "ASCII values are sent as they are"
    );
    let tenant = ra.header("tenant").unwrap();
    assert!(tenant.is_ascii(), "{tenant}");
    assert_eq!(percent_decode(&tenant), "Grüße, Zoë ✓ 東京");
    let rb = &reqs[&b.message_id.to_string()][0];
    assert_eq!(
        rb.header("content-type").unwrap(),
        "application/json; charset=utf-8"
    );
    assert_eq!(rb.headers.get_all("content-type").iter().count(), 1);
    assert_eq!(rb.header("note").unwrap(), "%20100%25 sure%20");
    assert_eq!(percent_decode(&rb.header("note").unwrap()), " 100% sure ");
    assert!(rb.body.is_empty());
    assert_eq!(reqs[&c.message_id.to_string()][0].body.len(), 1024 * 1024);
}

#[tokio::test]
async fn status_codes_map_to_ok_transient_and_permanent() {
    let long_body = format!("bad request: {}", "x".repeat(400));
    let body = long_body.clone();
    let server = TestServer::start(move |r, _| match r.header("topic").unwrap().as_str() {
        "t.ok" => Reply::status(200),
        "t.created" => Reply::status(201),
        "t.bad" => Reply::status(400).body(body.clone()),
        "t.gone" => Reply::status(410),
        "t.busy" => Reply::status(503).header("retry-after", "2"),
        "t.throttled" => {
            let at = Utc::now() + chrono::Duration::seconds(30);
            Reply::status(429).header(
                "retry-after",
                at.format("%a, %d %b %Y %H:%M:%S GMT").to_string(),
            )
        }
        "t.timeout" => Reply::status(408),
        "t.crash" => Reply::status(500),
        "t.moved" => Reply::status(301).header("location", "http://elsewhere.invalid/"),
        other => panic!("unexpected topic {other}"),
    })
    .await;
    let sink = webhook(&server.url).await;
    let topics = [
        "t.ok",
        "t.created",
        "t.bad",
        "t.gone",
        "t.busy",
        "t.throttled",
        "t.timeout",
        "t.crash",
        "t.moved",
    ];
    let batch: Vec<_> = topics.iter().map(|t| outgoing(t, b"x".to_vec())).collect();
    let results = sink.publish_all(&batch).await;
    let by_topic: HashMap<&str, _> = topics.iter().copied().zip(results).collect();

    assert_eq!(by_topic["t.ok"], Ok(()));
    assert_eq!(by_topic["t.created"], Ok(()));

    let bad = by_topic["t.bad"].clone().unwrap_err();
    assert_eq!(bad.kind, ErrorKind::Permanent);
    assert!(bad.message.contains("400"), "{bad}");
    // The status and the body's length, never the body (it may echo the payload).
    assert!(!bad.message.contains("bad request"), "{bad}");
    assert!(
        bad.message
            .ends_with("400 Bad Request (response body of 413 bytes not shown)"),
        "{bad}"
    );
    assert_eq!(bad.retry_after, None);
    assert_eq!(
        by_topic["t.gone"].clone().unwrap_err().kind,
        ErrorKind::Permanent
    );

    // 503 and 429 are destination pressure: unavailable, with Retry-After.
    let busy = by_topic["t.busy"].clone().unwrap_err();
    assert_eq!(busy.kind, ErrorKind::Unavailable);
    assert!(busy.message.contains("503"), "{busy}");
    assert_eq!(busy.retry_after, Some(Duration::from_secs(2)));

    let throttled = by_topic["t.throttled"].clone().unwrap_err();
    assert_eq!(throttled.kind, ErrorKind::Unavailable);
    let after = throttled.retry_after.unwrap();
    assert!(
        after > Duration::from_secs(27) && after <= Duration::from_secs(30),
        "HTTP-date Retry-After: {after:?}"
    );
    for t in ["t.timeout", "t.crash"] {
        let e = by_topic[t].clone().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Transient, "{t}: {e}");
        assert_eq!(e.retry_after, None);
    }
    let moved = by_topic["t.moved"].clone().unwrap_err();
    assert_eq!(moved.kind, ErrorKind::Permanent);
    assert!(moved.message.contains("not followed"), "{moved}");

    // Each message was sent exactly once: the sink itself never retries.
    let reqs = server.by_key();
    assert_eq!(reqs.len(), topics.len());
    assert!(reqs.values().all(|v| v.len() == 1));
}

#[tokio::test]
async fn a_slow_endpoint_times_out() {
    let server = TestServer::start(|_, _| Reply {
        delay: Duration::from_secs(3),
        ..Reply::status(200)
    })
    .await;
    let sink = WebhookSink::connect_with(
        &server.url,
        WebhookOptions {
            timeout: Duration::from_millis(300),
            ..WebhookOptions::default()
        },
    )
    .await
    .unwrap();
    let start = Instant::now();
    let r = sink.publish_all(&[outgoing("t.slow", b"x".to_vec())]).await;
    let e = r[0].clone().unwrap_err();
    assert_eq!(e.kind, ErrorKind::TimedOut, "{e}");
    assert!(e.message.contains("did not answer"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn connection_refused_is_unavailable() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://user:hunter2@127.0.0.1:{port}/in?token=s3cret");
    let sink = webhook(&url).await;
    let d = sink.describe();
    // The user name stays (as for every sink URL); the password and query do not.
    assert!(
        !d.contains("hunter2") && !d.contains("s3cret") && d.contains("user:***@"),
        "{d}"
    );
    let r = sink
        .publish_all(&[outgoing("t.a", b"x".to_vec()), outgoing("t.b", vec![])])
        .await;
    for e in r {
        let e = e.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
        assert!(
            !e.message.contains("s3cret") && !e.message.contains("hunter2"),
            "{e}"
        );
    }
    // The TLS client builds (one rustls provider in the process) and fails the same way.
    let tls = webhook(&format!("https://127.0.0.1:{port}/in")).await;
    let e = tls.publish_all(&[outgoing("t.a", b"x".to_vec())]).await[0]
        .clone()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
}

#[tokio::test]
async fn userinfo_is_sent_as_basic_auth_and_the_query_is_kept() {
    let server = TestServer::ok().await;
    let url = server
        .url
        .replace("http://", "http://relay:s%40cret@")
        .replace("/hooks/in", "/hooks/in?tenant=acme");
    let sink = webhook(&url).await;
    assert!(!sink.describe().contains("cret") && !sink.describe().contains("acme"));
    assert_eq!(
        sink.publish_all(&[outgoing("t.auth", b"x".to_vec())]).await,
        vec![Ok(())]
    );
    let r = &server.requests()[0];
    let expected = base64::engine::general_purpose::STANDARD.encode("relay:s@cret");
    assert_eq!(
        r.header("authorization").unwrap(),
        format!("Basic {expected}")
    );
    assert_eq!(r.uri, "/hooks/in?tenant=acme");
}

#[tokio::test]
async fn headers_http_owns_are_refused_permanently_and_the_rest_still_go() {
    let server = TestServer::ok().await;
    let sink = webhook(&server.url).await;
    let batch = vec![
        with_header(outgoing("t.a", b"1".to_vec()), "content-length", "1000"),
        with_header(outgoing("t.b", b"2".to_vec()), "Host", "evil.example"),
        with_header(
            outgoing("t.c", b"3".to_vec()),
            "webhook-signature",
            "v1,forged",
        ),
        with_header(
            outgoing("t.d", b"4".to_vec()),
            "content-type",
            "text/plain\u{e9}",
        ),
        // A client's or proxy's header would be dropped by the receiver's decoder.
        with_header(outgoing("t.f", b"6".to_vec()), "Authorization", "Bearer x"),
        with_header(
            outgoing("t.g", b"7".to_vec()),
            "x-forwarded-for",
            "10.0.0.1",
        ),
        // Names that differ only in case are one HTTP header.
        with_header(outgoing("t.h", b"8".to_vec()), "Message-Id", "forged"),
        with_header(
            with_header(outgoing("t.i", b"9".to_vec()), "Tenant", "a"),
            "tenant",
            "b",
        ),
        outgoing("t.e", b"5".to_vec()),
    ];
    let r = sink.publish_all(&batch).await;
    let last = batch.len() - 1;
    for (i, e) in r[..last].iter().enumerate() {
        assert_eq!(e.clone().unwrap_err().kind, ErrorKind::Permanent, "{i}");
    }
    assert!(
        r[7].clone()
            .unwrap_err()
            .message
            .contains("case-insensitive"),
        "{:?}",
        r[7]
    );
    assert_eq!(r[last], Ok(()));
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn standard_webhooks_signature_verifies() {
    let server = TestServer::ok().await;
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let sink = WebhookSink::connect_with(
        &server.url,
        WebhookOptions {
            secret: Some(WebhookSecret::parse(secret, "test").unwrap()),
            ..WebhookOptions::default()
        },
    )
    .await
    .unwrap();
    assert!(sink.is_signed());
    assert!(!sink.describe().contains("MfKQ9r8"));
    let batch = vec![
        outgoing("t.sig", br#"{"test": 2432232314}"#.to_vec()),
        outgoing("t.sig", vec![0xff, 0x00, 0x80]),
        outgoing("t.sig", vec![]),
    ];
    assert!(sink.publish_all(&batch).await.iter().all(Result::is_ok));

    // The receiver's side, written from the spec: HMAC-SHA256 with the decoded key over
    // "{webhook-id}.{webhook-timestamp}.{body}", base64, prefixed "v1,".
    let key = base64::engine::general_purpose::STANDARD
        .decode(secret.strip_prefix("whsec_").unwrap())
        .unwrap();
    let now = Utc::now().timestamp();
    for r in server.requests() {
        let id = r.header("webhook-id").unwrap();
        assert_eq!(id, r.key(), "webhook-id is the message id");
        let ts = r.header("webhook-timestamp").unwrap();
        assert!(
            (ts.parse::<i64>().unwrap() - now).abs() <= 5,
            "{ts} vs {now}"
        );
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
        mac.update(format!("{id}.{ts}.").as_bytes());
        mac.update(&r.body);
        let expected = format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
        );
        assert_eq!(r.header("webhook-signature").unwrap(), expected);
        // The library's receiver side agrees, and refuses a body changed on the way.
        let verifier = WebhookSecret::parse(secret, "test").unwrap();
        assert_eq!(verifier.verify_headers(&r.headers, &r.body), Ok(()));
        let mut tampered = r.body.to_vec();
        tampered.push(b' ');
        assert_eq!(
            verifier.verify_headers(&r.headers, &tampered),
            Err(outbox::webhook::VerifyError::NoMatch)
        );
        let env = outbox::envelope::from_webhook(&r.headers, r.body.clone()).unwrap();
        assert_eq!(env.message_id.to_string(), id);
        assert_eq!(env.topic, "t.sig");
    }
}

// ---------------------------------------------------------------------------------------
// Through the relay (SQLite store)
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_honours_retry_after_then_delivers() {
    const N: usize = 10;
    // The first attempt of every message is refused with 503 + Retry-After: 2; the next
    // one succeeds.
    let server = TestServer::start(|_, earlier| {
        if earlier == 0 {
            Reply::status(503).header("retry-after", "2")
        } else {
            Reply::status(200)
        }
    })
    .await;
    let db = crate::store::conformance_sqlite::SqliteBackend::create(
        "sqlite",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let msgs = crate::common::messages("orders.retry.v1", N);
    db.enqueue_all(&msgs).await;
    // Backoff alone would retry within 200 ms: only Retry-After can hold it for 2 s.
    let cfg = relay_config("relay-http-retry");
    let handle = Relay::new(db.store(), Arc::new(webhook(&server.url).await), cfg).spawn();
    let d = &db;
    wait_until(
        "every message dispatched",
        Duration::from_secs(20),
        || async move {
            let rows = d.rows().await;
            let done = rows.iter().filter(|r| r.status == 2).count();
            if done == N {
                Ok(())
            } else {
                Err(format!("{done}/{N} dispatched"))
            }
        },
    )
    .await;
    handle.shutdown().await.unwrap();

    let reqs = server.by_key();
    assert_eq!(reqs.len(), N);
    for (key, attempts) in &reqs {
        assert_eq!(attempts.len(), 2, "{key}: one 503, then one success");
        let gap = attempts[1].at - attempts[0].at;
        assert!(
            gap >= Duration::from_millis(1990),
            "{key}: retried after {gap:?}, before Retry-After's 2 s"
        );
    }
    // The 503 was destination pressure: it gave its attempt back.
    for r in db.rows().await {
        assert_eq!((r.status, r.attempts), (2, 1), "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_quarantines_a_400_after_one_attempt() {
    const N: usize = 5;
    let server = TestServer::start(|_, _| Reply::status(400).body("schema violation")).await;
    let db = crate::store::conformance_sqlite::SqliteBackend::create(
        "sqlite",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    db.enqueue_all(&crate::common::messages("orders.rejected.v1", N))
        .await;
    let cfg = relay_config("relay-http-400");
    let handle = Relay::new(db.store(), Arc::new(webhook(&server.url).await), cfg).spawn();
    let d = &db;
    wait_until(
        "every message quarantined",
        Duration::from_secs(20),
        || async move {
            let rows = d.rows().await;
            let dead = rows.iter().filter(|r| r.status == 3).count();
            if dead == N {
                Ok(())
            } else {
                Err(format!("{dead}/{N} dead: {rows:?}"))
            }
        },
    )
    .await;
    // Give a wrongly scheduled retry the chance to show up: five more claims (a poll
    // every 100 ms, past the 50 ms backoff).
    crate::common::wait_claims("five more claims", &handle, 5, Duration::from_secs(10)).await;
    handle.shutdown().await.unwrap();
    for r in db.rows().await {
        assert_eq!((r.status, r.attempts), (3, 1), "{r:?}");
        let err = r.last_error.unwrap();
        // The status and the body's length; the body itself may be the payload.
        assert!(
            err.contains("400 Bad Request") && err.contains("16 bytes") && !err.contains("schema"),
            "{err}"
        );
    }
    assert_eq!(server.requests().len(), N, "one attempt per message");
}
