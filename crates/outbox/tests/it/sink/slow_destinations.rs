//! The relay under slow destinations, against PostgreSQL and a controllable webhook
//! endpoint: confirmations are per message (a slow message does not take its batch down
//! with it, the shutdown grace keeps what was confirmed), and a slow but live publish
//! keeps its claim past the lease.

#![allow(clippy::unwrap_used)]

use crate::common::{messages, relay_config, wait_until};
use crate::store::conformance::Backend as _;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use outbox::Relay;
use outbox::sink::http::{WebhookOptions, WebhookSink};
use outbox::store::status;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the endpoint answers one payload: after `delay` with 200; `None` = never.
type Behaviour = Arc<dyn Fn(&[u8]) -> Option<Duration> + Send + Sync>;

#[derive(Clone)]
struct Endpoint {
    deliveries: Arc<Mutex<HashMap<String, u32>>>,
    /// Requests answered (200 sent).
    answered: Arc<AtomicU32>,
    behaviour: Behaviour,
}

async fn handle(State(e): State<Endpoint>, headers: HeaderMap, body: Bytes) -> &'static str {
    let id = headers
        .get("webhook-id")
        .or_else(|| headers.get("idempotency-key"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    *e.deliveries.lock().unwrap().entry(id).or_default() += 1;
    match (e.behaviour)(&body) {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending::<()>().await,
    }
    e.answered.fetch_add(1, Ordering::SeqCst);
    "ok"
}

/// Starts the endpoint; returns its URL, the deliveries it received per message id and
/// how many it answered.
async fn endpoint(
    behaviour: Behaviour,
) -> (String, Arc<Mutex<HashMap<String, u32>>>, Arc<AtomicU32>) {
    let deliveries = Arc::new(Mutex::new(HashMap::new()));
    let answered = Arc::new(AtomicU32::new(0));
    let state = Endpoint {
        deliveries: deliveries.clone(),
        answered: answered.clone(),
        behaviour,
    };
    let app = axum::Router::new()
        .fallback(axum::routing::post(handle))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, deliveries, answered)
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

fn count(d: &Mutex<HashMap<String, u32>>, id: &str) -> u32 {
    d.lock().unwrap().get(id).copied().unwrap_or(0)
}

/// One slow message in a batch of five, while other traffic flows: the four fast ones are
/// delivered once and marked; the slow one times out on its own, counts attempts (the
/// endpoint confirmed other messages meanwhile) and is quarantined with a reason that says
/// it timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_message_times_out_alone() {
    let (url, deliveries, _) = endpoint(Arc::new(|body: &[u8]| {
        (body != b"payload-2").then_some(Duration::from_millis(10))
    }))
    .await;
    let db = Arc::new(
        crate::store::conformance_postgres::PgBackend::create(
            "slow_one",
            crate::store::conformance::DEFAULT_MAX,
        )
        .await,
    );
    let enq = db.enqueue_all(&messages("hooks.slow.v1", 5)).await;
    let mut cfg = relay_config("relay-slow-one");
    cfg.publish_timeout = Duration::from_millis(800);
    cfg.max_attempts = 2;
    cfg.backoff_base = Duration::from_millis(50);
    let handle = Relay::new(
        db.store(),
        webhook(&url, Duration::from_secs(10)).await,
        cfg,
    )
    .spawn();
    // Other traffic to the same endpoint, confirmed promptly.
    let background = {
        let db = db.clone();
        tokio::spawn(async move {
            loop {
                db.enqueue_all(&messages("hooks.other.v1", 1)).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();
    let d = &db;
    let ids = &ids;
    wait_until("the five settled", Duration::from_secs(15), || async move {
        let mut settled = 0;
        for id in ids {
            settled += usize::from(d.row(*id).await.status >= 2);
        }
        if settled == 5 {
            Ok(())
        } else {
            Err(format!("{settled}/5 settled"))
        }
    })
    .await;
    background.abort();
    let stats = handle.shutdown().await.unwrap();
    for (i, e) in enq.iter().enumerate() {
        let r = db.row(e.id).await;
        let sent = count(&deliveries, &e.message_id.to_string());
        if i == 2 {
            assert_eq!(r.status, status::DEAD, "{r:?}");
            assert_eq!(r.attempts, 2, "{r:?}");
            let error = r.last_error.unwrap();
            assert!(error.contains("timed out"), "{error}");
            assert_eq!(sent, 2, "one delivery per attempt");
        } else {
            assert_eq!(r.status, status::DISPATCHED, "{r:?}");
            assert_eq!(sent, 1, "a confirmed message is never re-sent: {r:?}");
        }
    }
    assert_eq!(stats.quarantined, 1, "{stats:?}");
}

/// The shutdown grace runs out with part of a batch confirmed: the confirmed messages are
/// marked, the rest released (attempt given back) and delivered once by the next relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_shutdown_grace_keeps_confirmations() {
    let fast = |body: &[u8]| {
        let n: u32 = std::str::from_utf8(body)
            .unwrap()
            .trim_start_matches("payload-")
            .parse()
            .unwrap();
        n < 4
    };
    let (url, deliveries, answered) = endpoint(Arc::new(move |body: &[u8]| {
        fast(body).then_some(Duration::from_millis(10))
    }))
    .await;
    let db = crate::store::conformance_postgres::PgBackend::create(
        "grace",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let enq = db.enqueue_all(&messages("hooks.grace.v1", 10)).await;
    let mut cfg = relay_config("relay-grace");
    cfg.shutdown_grace = Duration::from_millis(500);
    cfg.publish_timeout = Duration::from_secs(30);
    let handle = Relay::new(
        db.store(),
        webhook(&url, Duration::from_secs(30)).await,
        cfg,
    )
    .spawn();
    let d = deliveries.clone();
    wait_until("all ten sent", Duration::from_secs(10), || {
        let n: u32 = d.lock().unwrap().values().sum();
        async move {
            if n == 10 {
                Ok(())
            } else {
                Err(format!("{n}/10"))
            }
        }
    })
    .await;
    let a = &answered;
    wait_until(
        "the four fast ones answered",
        Duration::from_secs(10),
        || async move {
            match a.load(Ordering::SeqCst) {
                4 => Ok(()),
                n => Err(format!("{n} answered")),
            }
        },
    )
    .await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!((stats.dispatched, stats.released), (4, 6), "{stats:?}");
    for (i, e) in enq.iter().enumerate() {
        let r = db.row(e.id).await;
        if i < 4 {
            assert_eq!(r.status, status::DISPATCHED, "{r:?}");
        } else {
            assert_eq!((r.status, r.attempts), (status::PENDING, 0), "{r:?}");
        }
    }

    // The next relay, to an endpoint that answers everything, sends only the released six.
    let (url2, deliveries2, _) = endpoint(Arc::new(|_: &[u8]| Some(Duration::ZERO))).await;
    let mut cfg = relay_config("relay-grace-2");
    cfg.drain = true;
    Relay::new(
        db.store(),
        webhook(&url2, Duration::from_secs(5)).await,
        cfg,
    )
    .run(tokio_util::sync::CancellationToken::new())
    .await
    .unwrap();
    for (i, e) in enq.iter().enumerate() {
        let id = e.message_id.to_string();
        let again = count(&deliveries2, &id);
        assert_eq!(
            again,
            u32::from(i >= 4),
            "message {i} sent again {again} times"
        );
    }
}

/// A publish slower than the lease keeps its claim: the lease is renewed while it is in
/// flight, a second relay never takes the rows, and each message is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_but_live_publish_keeps_its_lease() {
    let (url, deliveries, _) =
        endpoint(Arc::new(|_: &[u8]| Some(Duration::from_millis(2_500)))).await;
    let db = crate::store::conformance_postgres::PgBackend::create(
        "renew",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let enq = db.enqueue_all(&messages("hooks.renew.v1", 3)).await;
    let mut cfg = relay_config("relay-renew-a");
    cfg.lease = Duration::from_millis(900);
    cfg.publish_timeout = Duration::from_secs(10);
    let a = Relay::new(
        db.store(),
        webhook(&url, Duration::from_secs(10)).await,
        cfg.clone(),
    )
    .spawn();
    let d = deliveries.clone();
    wait_until("all three sent", Duration::from_secs(5), || {
        let n: u32 = d.lock().unwrap().values().sum();
        async move {
            if n == 3 {
                Ok(())
            } else {
                Err(format!("{n}/3"))
            }
        }
    })
    .await;
    // A second relay runs through the whole slow publish, well past the first lease.
    cfg.relay_id = "relay-renew-b".into();
    let b = Relay::new(
        db.store(),
        webhook(&url, Duration::from_secs(10)).await,
        cfg,
    )
    .spawn();
    let dd = &db;
    wait_until("all dispatched", Duration::from_secs(10), || async move {
        let n = dd.rows().await.iter().filter(|r| r.status == 2).count();
        if n == 3 {
            Ok(())
        } else {
            Err(format!("{n}/3"))
        }
    })
    .await;
    let sa = a.shutdown().await.unwrap();
    let sb = b.shutdown().await.unwrap();
    assert!(sa.lease_renewals >= 2, "{sa:?}");
    assert_eq!((sa.dispatched, sa.lost_claims), (3, 0), "{sa:?}");
    assert_eq!(
        sb.claimed, 0,
        "the second relay took rows under a live lease: {sb:?}"
    );
    for e in &enq {
        assert_eq!(count(&deliveries, &e.message_id.to_string()), 1);
        let r = db.row(e.id).await;
        assert_eq!(r.attempts, 1, "{r:?}");
    }
}

/// An endpoint that accepts connections and answers nothing (a blackhole) takes the
/// requests, so its timeouts come after sending: each message has one request outstanding
/// at a time, its first `TIMEOUT_REFUNDS` timeouts spend no attempt and only later ones do
/// (bounded re-sends, where an outage of an unreachable endpoint spends none); once it
/// answers again every message is delivered and none was quarantined.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blackholed_endpoint_spends_attempts_only_after_the_refunds() {
    use outbox::sink::router::TIMEOUT_REFUNDS;
    let answering = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let a = answering.clone();
    let (url, deliveries, _) = endpoint(Arc::new(move |_: &[u8]| {
        a.load(std::sync::atomic::Ordering::SeqCst)
            .then_some(Duration::ZERO)
    }))
    .await;
    let db = crate::store::conformance_postgres::PgBackend::create(
        "blackhole",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let enq = db.enqueue_all(&messages("hooks.blackhole.v1", 5)).await;
    let mut cfg = relay_config("relay-blackhole");
    cfg.publish_timeout = Duration::from_millis(300);
    cfg.max_attempts = 10;
    let handle = Relay::new(
        db.store(),
        webhook(&url, Duration::from_millis(500)).await,
        cfg,
    )
    .spawn();
    // Every message's refunded timeouts' worth of blackhole.
    let d = deliveries.clone();
    wait_until("several tries", Duration::from_secs(20), || {
        let n: u32 = d.lock().unwrap().values().sum();
        async move {
            if n >= 5 * TIMEOUT_REFUNDS {
                Ok(())
            } else {
                Err(format!("{n} requests"))
            }
        }
    })
    .await;
    for e in &enq {
        let r = db.row(e.id).await;
        // Read after the row: at least the requests it had then.
        let sent = count(&deliveries, &e.message_id.to_string());
        assert!(r.status <= 1, "settled during the blackhole: {r:?}");
        // Counted timeouts only past the refunded ones (+1 while claimed).
        let counted = i32::try_from(sent.saturating_sub(TIMEOUT_REFUNDS)).unwrap();
        assert!(
            r.attempts <= counted + 1,
            "{sent} requests, attempts {}: {r:?}",
            r.attempts
        );
    }
    answering.store(true, std::sync::atomic::Ordering::SeqCst);
    let dd = &db;
    wait_until(
        "delivered once it answers",
        Duration::from_secs(10),
        || async move {
            let n = dd.rows().await.iter().filter(|r| r.status == 2).count();
            if n == 5 {
                Ok(())
            } else {
                Err(format!("{n}/5"))
            }
        },
    )
    .await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.quarantined, 0, "{stats:?}");
}
