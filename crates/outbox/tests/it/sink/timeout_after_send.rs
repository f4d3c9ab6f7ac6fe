//! A destination that takes the request and does not answer within the publish timeout,
//! against PostgreSQL and an in-test HTTP endpoint that sees every request and every
//! connection: the message is never sent again while an earlier request for it is still
//! outstanding, a late `2xx` confirms it without another copy, and a destination that never
//! answers in time gets a bounded number of requests (a few given back, then
//! `max_attempts`) before the message is quarantined with a reason that says it timed out
//! after the request was sent. A destination that cannot be reached (connection refused)
//! spends no attempt, however long.

#![allow(clippy::unwrap_used)]

use crate::common::{messages, relay_config, wait_until};
use crate::store::conformance::Backend as _;
use outbox::Relay;
use outbox::sink::http::{WebhookOptions, WebhookSink};
use outbox::sink::router::TIMEOUT_REFUNDS;
use outbox::store::status;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the endpoint saw: requests per `Idempotency-Key`, requests outstanding now (read,
/// not yet answered, connection still open) and the most outstanding at once.
#[derive(Default)]
struct Seen {
    requests: Mutex<HashMap<String, u32>>,
    outstanding: AtomicUsize,
    most_outstanding: AtomicUsize,
}

impl Seen {
    fn requests(&self, id: &str) -> u32 {
        self.requests.lock().unwrap().get(id).copied().unwrap_or(0)
    }
}

/// Counts a request as outstanding while it lives.
struct Outstanding<'a>(&'a Seen);

impl<'a> Outstanding<'a> {
    fn start(seen: &'a Seen) -> Self {
        let now = seen.outstanding.fetch_add(1, Ordering::SeqCst) + 1;
        seen.most_outstanding.fetch_max(now, Ordering::SeqCst);
        Outstanding(seen)
    }
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Reads one HTTP/1.1 request (head and `Content-Length` body); `None` when the client
/// closed the connection.
async fn read_request(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + len {
                buf.drain(..end + 4 + len);
                return Some(head);
            }
        }
        let mut chunk = [0u8; 4096];
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Serves one connection: each request is held for `hold` (`None`: until the client gives
/// up), then answered `200`. A client that closes the connection ends its request.
async fn serve(mut conn: TcpStream, seen: Arc<Seen>, hold: Option<Duration>) {
    let mut buf = Vec::new();
    while let Some(head) = read_request(&mut conn, &mut buf).await {
        let id = head
            .lines()
            .find_map(|l| l.strip_prefix("idempotency-key:"))
            .unwrap_or_default()
            .trim()
            .to_owned();
        *seen.requests.lock().unwrap().entry(id).or_default() += 1;
        let _outstanding = Outstanding::start(&seen);
        // Held until the hold ends or the client closes the connection, whichever first.
        let mut probe = [0u8; 1];
        let closed = async {
            let _ = conn.read(&mut probe).await;
        };
        let held = async {
            match hold {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = closed => return,
            () = held => {}
        }
        if conn
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Starts the endpoint; returns its URL and what it sees.
async fn endpoint(hold: Option<Duration>) -> (String, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let (conn, _) = listener.accept().await.unwrap();
            tokio::spawn(serve(conn, s.clone(), hold));
        }
    });
    (url, seen)
}

async fn webhook(url: &str, timeout: Duration) -> Arc<WebhookSink> {
    Arc::new(
        WebhookSink::connect_with(
            url,
            WebhookOptions {
                timeout,
                ..WebhookOptions::default()
            },
        )
        .await
        .unwrap(),
    )
}

/// An endpoint that answers after 2 s, a publish timeout of 300 ms: the relay stops
/// waiting, but the request stays open (the webhook's own 10 s bound); the message is not
/// sent again meanwhile, and the late `200` confirms it: one request in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_endpoint_gets_one_copy_and_its_late_answer_confirms() {
    let (url, seen) = endpoint(Some(Duration::from_secs(2))).await;
    let db = crate::store::conformance_postgres::PgBackend::create(
        "late_answer",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let enq = db.enqueue_all(&messages("hooks.late.v1", 1)).await;
    let mut cfg = relay_config("relay-late-answer");
    cfg.publish_timeout = Duration::from_millis(300);
    cfg.max_attempts = 3;
    cfg.backoff_base = Duration::from_millis(50);
    let handle = Relay::new(
        db.store(),
        webhook(&url, Duration::from_secs(10)).await,
        cfg,
    )
    .spawn();
    let (d, id) = (&db, enq[0].id);
    wait_until("dispatched", Duration::from_secs(15), || async move {
        let r = d.row(id).await;
        if r.status == status::DISPATCHED {
            Ok(())
        } else {
            Err(format!("{r:?}"))
        }
    })
    .await;
    handle.shutdown().await.unwrap();
    let message_id = enq[0].message_id.to_string();
    assert_eq!(seen.requests(&message_id), 1, "copies sent");
    assert_eq!(seen.most_outstanding.load(Ordering::SeqCst), 1);
}

/// An endpoint that never answers within the webhook's own timeout (500 ms; the publish
/// timeout 300 ms): one request outstanding at a time, the first `TIMEOUT_REFUNDS`
/// timeouts given back, then `max_attempts` counted, and the message is quarantined with
/// a reason that says it timed out after the request was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_endpoint_that_never_answers_in_time_gets_bounded_requests() {
    let (url, seen) = endpoint(None).await;
    let db = crate::store::conformance_postgres::PgBackend::create(
        "never_answers",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let enq = db.enqueue_all(&messages("hooks.never.v1", 1)).await;
    let mut cfg = relay_config("relay-never-answers");
    cfg.publish_timeout = Duration::from_millis(300);
    cfg.max_attempts = 3;
    cfg.backoff_base = Duration::from_millis(50);
    cfg.backoff_max = Duration::from_millis(200);
    let handle = Relay::new(
        db.store(),
        webhook(&url, Duration::from_millis(500)).await,
        cfg,
    )
    .spawn();
    let (d, id) = (&db, enq[0].id);
    wait_until("quarantined", Duration::from_secs(20), || async move {
        let r = d.row(id).await;
        if r.status == status::DEAD {
            Ok(())
        } else {
            Err(format!("{r:?}"))
        }
    })
    .await;
    let stats = handle.shutdown().await.unwrap();
    let r = db.row(id).await;
    assert_eq!(r.attempts, 3, "{r:?}");
    let error = r.last_error.unwrap();
    assert!(
        error.contains("timed out after the request was sent"),
        "{error}"
    );
    assert!(error.contains("--publish-timeout-ms"), "{error}");
    let message_id = enq[0].message_id.to_string();
    assert_eq!(
        seen.requests(&message_id),
        TIMEOUT_REFUNDS + 3,
        "the refunded timeouts, then one request per attempt"
    );
    assert_eq!(seen.most_outstanding.load(Ordering::SeqCst), 1);
    assert_eq!(stats.quarantined, 1, "{stats:?}");
}

/// Connection refused (a closed port): the endpoint is unreachable, never slow; however
/// many tries, no attempt is spent and nothing is quarantined, even at `max_attempts` 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_connection_spends_no_attempt() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}/hook");
    let db = crate::store::conformance_postgres::PgBackend::create(
        "refused",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let enq = db.enqueue_all(&messages("hooks.refused.v1", 3)).await;
    let mut cfg = relay_config("relay-refused");
    cfg.publish_timeout = Duration::from_millis(300);
    cfg.max_attempts = 1;
    let handle = Relay::new(
        db.store(),
        webhook(&url, Duration::from_secs(10)).await,
        cfg,
    )
    .spawn();
    let h = &handle;
    wait_until("several tries", Duration::from_secs(20), || async move {
        let retried = h.stats().retried;
        if retried >= 9 {
            Ok(())
        } else {
            Err(format!("{retried} retries"))
        }
    })
    .await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.quarantined, 0, "{stats:?}");
    for e in &enq {
        let r = db.row(e.id).await;
        assert_eq!((r.status, r.attempts), (status::PENDING, 0), "{r:?}");
        let error = r.last_error.unwrap();
        assert!(error.contains("cannot reach"), "{error}");
    }
}
