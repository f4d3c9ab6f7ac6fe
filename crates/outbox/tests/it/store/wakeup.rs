//! The relay loop wakes on the store's signal (PostgreSQL `NOTIFY`, SQLite's watcher of
//! the database and WAL files, MySQL's probe of the newest id and the first due row), not
//! only on its poll: with a poll interval far longer than the test, a commit still gets
//! delivered at once.

#![allow(clippy::unwrap_used)]

use crate::common::{RecordingSink, messages, relay_config};
use crate::store::conformance::{Backend, DEFAULT_MAX};
use crate::store::conformance_mysql::MySqlBackend;
use crate::store::conformance_postgres::PgBackend;
use crate::store::conformance_sqlite::SqliteBackend;
use outbox::Relay;
use std::time::{Duration, Instant};

/// Waits until the relay has run `claims` claim statements.
async fn idle_after_claims(handle: &outbox::RelayHandle, claims: u64) {
    crate::common::wait_until("the relay's first claims", Duration::from_secs(10), || {
        let n = handle.stats().claims;
        async move {
            if n >= claims {
                Ok(())
            } else {
                Err(format!("{n} claims"))
            }
        }
    })
    .await;
}

async fn commit_wakes_an_idle_relay<B: Backend>(db: B) {
    let name = format!("{:?}", B::KIND);
    let store = db.store();
    let (sink, _seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-idle");
    cfg.poll_interval = Duration::from_secs(60);
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    // Let it find nothing and go to sleep on its wake-up channel (subscribed before its
    // first claim).
    idle_after_claims(&handle, 1).await;
    assert_eq!(handle.stats().batches, 0);

    for round in 1..=3 {
        let start = Instant::now();
        db.enqueue_all(&messages("t.wake.v1", 1)).await;
        let s = store.clone();
        crate::common::wait_dispatched(
            "delivery without polling",
            &s,
            usize::try_from(round).unwrap(),
            Duration::from_secs(5),
        )
        .await;
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(3),
            "{name}: woke too late: {took:?}"
        );
    }
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, 3, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_commit_wakes_an_idle_relay() {
    commit_wakes_an_idle_relay(PgBackend::create("wake", DEFAULT_MAX).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_commit_wakes_an_idle_relay() {
    commit_wakes_an_idle_relay(SqliteBackend::create("wake", DEFAULT_MAX).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_commit_wakes_an_idle_relay() {
    commit_wakes_an_idle_relay(MySqlBackend::create("wake", DEFAULT_MAX).await).await;
}

/// Counts the claims and pause reads an idle relay makes, over a real store.
struct Counting {
    inner: std::sync::Arc<dyn outbox::Store>,
    claims: std::sync::atomic::AtomicU32,
    pause_reads: std::sync::atomic::AtomicU32,
}

#[async_trait::async_trait]
impl outbox::store::Relaying for Counting {
    async fn check_schema(&self) -> outbox::Result<()> {
        self.inner.check_schema().await
    }
    async fn claim(
        &self,
        req: &outbox::store::ClaimRequest,
    ) -> outbox::Result<outbox::store::Claim> {
        self.claims
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.claim(req).await
    }
    async fn settle(
        &self,
        token: uuid::Uuid,
        s: &outbox::store::Settlement,
    ) -> outbox::Result<outbox::store::Settled> {
        self.inner.settle(token, s).await
    }
    async fn renew(
        &self,
        token: uuid::Uuid,
        ids: &[i64],
        lease: Duration,
    ) -> outbox::Result<Vec<i64>> {
        self.inner.renew(token, ids, lease).await
    }
    async fn pause_state(&self) -> outbox::Result<outbox::store::PauseState> {
        self.pause_reads
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.pause_state().await
    }
    fn wakeups(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.wakeups()
    }
    fn nothing_due(&self, poll_interval: Duration) -> bool {
        self.inner.nothing_due(poll_interval)
    }
    fn one_writer(&self) -> bool {
        self.inner.one_writer()
    }
}

#[async_trait::async_trait]
impl outbox::store::Maintenance for Counting {
    async fn migrate(&self) -> outbox::Result<()> {
        self.inner.migrate().await
    }
    async fn purge(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> outbox::Result<outbox::store::PurgeBatch> {
        self.inner.purge(older_than, batch_size).await
    }
    async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> outbox::Result<u64> {
        self.inner.inbox_purge(older_than, batch_size).await
    }
    async fn count_purgeable(&self, older_than: Duration) -> outbox::Result<u64> {
        self.inner.count_purgeable(older_than).await
    }
    async fn count_inbox_purgeable(&self, older_than: Duration) -> outbox::Result<u64> {
        self.inner.count_inbox_purgeable(older_than).await
    }
    async fn park_held(&self, ordering: &outbox::store::KeyOrdering) -> outbox::Result<u64> {
        self.inner.park_held(ordering).await
    }
    async fn unpark_released(&self, ordering: &outbox::store::KeyOrdering) -> outbox::Result<u64> {
        self.inner.unpark_released(ordering).await
    }
}

#[async_trait::async_trait]
impl outbox::store::Registry for Counting {
    async fn heartbeat(&self, beat: &outbox::store::RelayHeartbeat) -> outbox::Result<()> {
        self.inner.heartbeat(beat).await
    }
    async fn deregister(&self, relay_id: &str, instance: &str) -> outbox::Result<()> {
        self.inner.deregister(relay_id, instance).await
    }
    async fn relays(&self, within: Duration) -> outbox::Result<Vec<outbox::store::RelayRecord>> {
        self.inner.relays(within).await
    }
}

#[async_trait::async_trait]
impl outbox::store::Operations for Counting {
    async fn set_pause(&self, reason: Option<&str>) -> outbox::Result<()> {
        self.inner.set_pause(reason).await
    }
    async fn dead_letters(
        &self,
        selector: &outbox::store::DeadSelector,
        limit: u32,
        with_payload: bool,
    ) -> outbox::Result<Vec<outbox::store::DeadLetter>> {
        self.inner.dead_letters(selector, limit, with_payload).await
    }
    async fn count_dead(&self, selector: &outbox::store::DeadSelector) -> outbox::Result<u64> {
        self.inner.count_dead(selector).await
    }
    async fn replay(
        &self,
        request: &outbox::store::ReplayRequest,
    ) -> outbox::Result<outbox::store::ReplayOutcome> {
        self.inner.replay(request).await
    }
    async fn replays(&self, limit: u32) -> outbox::Result<Vec<outbox::store::ReplayRecord>> {
        self.inner.replays(limit).await
    }
    async fn pause_topic(
        &self,
        pattern: &outbox::sink::router::TopicPattern,
        reason: &str,
        by: &str,
    ) -> outbox::Result<()> {
        self.inner.pause_topic(pattern, reason, by).await
    }
    async fn resume_topic(&self, pattern: &str) -> outbox::Result<bool> {
        self.inner.resume_topic(pattern).await
    }
    async fn audit(&self, entry: &outbox::store::ops::AuditEntry) -> outbox::Result<()> {
        self.inner.audit(entry).await
    }
}

#[async_trait::async_trait]
impl outbox::store::Views for Counting {
    async fn counts(&self) -> outbox::Result<outbox::Counts> {
        self.inner.counts().await
    }
    async fn leases(&self) -> outbox::Result<outbox::store::Leases> {
        self.inner.leases().await
    }
    async fn overview(&self, top_n: u32) -> outbox::Result<outbox::store::Overview> {
        self.inner.overview(top_n).await
    }
    async fn held_keys(
        &self,
        ordering: &outbox::store::KeyOrdering,
    ) -> outbox::Result<outbox::store::HeldKeys> {
        self.inner.held_keys(ordering).await
    }
    async fn due_held_by_order(
        &self,
        ordering: &outbox::store::KeyOrdering,
    ) -> outbox::Result<outbox::store::DueHeld> {
        self.inner.due_held_by_order(ordering).await
    }
    async fn find_messages(
        &self,
        query: &outbox::store::lookup::MessageQuery,
        limit: u32,
    ) -> outbox::Result<Vec<outbox::store::lookup::MessageLocation>> {
        self.inner.find_messages(query, limit).await
    }
    async fn throughput(
        &self,
        minutes: u32,
    ) -> outbox::Result<Vec<outbox::store::lookup::MinuteCounts>> {
        self.inner.throughput(minutes).await
    }
}

/// Idle, a relay with several workers makes one claim per poll interval (not one per
/// worker) and reads the pause switch at most about once a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_relay_claims_once_per_poll_interval() {
    let db = crate::store::conformance_postgres::PgBackend::create(
        "idle_claims",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let store = std::sync::Arc::new(Counting {
        inner: db.store(),
        claims: Default::default(),
        pause_reads: Default::default(),
    });
    let (sink, _seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-idle-claims");
    cfg.poll_interval = Duration::from_millis(250);
    cfg.in_flight_batches = 4;
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    // Past the start (each worker's first claim, the listener's first wake-up).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let load = |a: &std::sync::atomic::AtomicU32| a.load(std::sync::atomic::Ordering::SeqCst);
    let (claims0, pauses0) = (load(&store.claims), load(&store.pause_reads));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let claims = load(&store.claims) - claims0;
    let pauses = load(&store.pause_reads) - pauses0;
    let _ = handle.shutdown().await.unwrap();
    eprintln!(
        "idle for 3 s at a 250 ms poll with 4 workers: {claims} claims, {pauses} pause reads"
    );
    // 12 poll intervals (one claim per worker would be 48); the pause switch once a second.
    assert!(claims <= 14, "{claims} claims");
    assert!(pauses <= 4, "{pauses} pause reads");
}

/// On MySQL, which has no notification, an idle relay's poll is answered by the store's
/// wake-up probe (one statement): no claim transaction runs while the probe finds no row
/// claimable, and a commit still wakes the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_mysql_relay_claims_only_when_its_probe_finds_rows() {
    let db = MySqlBackend::create("idle_probe", DEFAULT_MAX).await;
    let store = std::sync::Arc::new(Counting {
        inner: db.store(),
        claims: Default::default(),
        pause_reads: Default::default(),
    });
    let (sink, _seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-idle-probe");
    cfg.poll_interval = Duration::from_millis(250);
    cfg.in_flight_batches = 4;
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    // Past the start (the first claims, the probe's first looks).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let load = |a: &std::sync::atomic::AtomicU32| a.load(std::sync::atomic::Ordering::SeqCst);
    let claims0 = load(&store.claims);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let claims = load(&store.claims) - claims0;
    eprintln!("idle for 3 s at a 250 ms poll with 4 workers: {claims} claims");
    // Twelve polls, none of which the probe saw a claimable row for.
    assert!(claims <= 1, "{claims} claims");

    let s: std::sync::Arc<dyn outbox::Store> = store.clone();
    db.enqueue_all(&messages("t.probe.v1", 1)).await;
    crate::common::wait_dispatched("a commit after the quiet", &s, 1, Duration::from_secs(5)).await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, 1);
}

/// Rows that fall due without a new commit (a lease that ran out, a delayed message) wake
/// an idle MySQL relay through its probe: its poll interval here is longer than the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_rows_falling_due_wake_an_idle_relay() {
    let db = MySqlBackend::create("due_wake", DEFAULT_MAX).await;
    let store = db.store();
    // A crashed relay's claim, whose lease runs out 2 s from now.
    db.enqueue_all(&messages("t.due.v1", 1)).await;
    let crashed = store
        .claim(&outbox::store::ClaimRequest {
            relay_id: "crashed".into(),
            batch_size: 10,
            lease: Duration::from_secs(2),
            skip_topics: Vec::new(),
            ordering: outbox::store::KeyOrdering::default(),
        })
        .await
        .unwrap();
    assert_eq!(crashed.messages.len(), 1);
    let (sink, _seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-due");
    cfg.poll_interval = Duration::from_secs(60);
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    let start = Instant::now();
    crate::common::wait_dispatched(
        "the row whose lease ran out",
        &store,
        1,
        Duration::from_secs(10),
    )
    .await;
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(1_500),
        "claimed under a live lease: {took:?}"
    );

    db.enqueue_all(&[
        outbox::Message::new("t.due.v1", b"later".to_vec()).delay(Duration::from_millis(1_500))
    ])
    .await;
    let start = Instant::now();
    crate::common::wait_dispatched("the delayed message", &store, 2, Duration::from_secs(10)).await;
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(1_400),
        "published early: {took:?}"
    );
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, 2);
}

/// Holds its first batch until released; records every message it is handed.
struct HoldFirst {
    seen: crate::common::Seen,
    release: tokio::sync::Semaphore,
    first: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl outbox::sink::Sink for HoldFirst {
    async fn publish(
        &self,
        batch: &[outbox::OutgoingMessage],
        confirm: &outbox::sink::Confirmations,
    ) {
        crate::common::record(&self.seen, batch);
        if self.first.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let _ = self.release.acquire().await.unwrap();
        }
        for i in 0..batch.len() {
            confirm.set(i, Ok(()));
        }
    }

    fn describe(&self) -> String {
        "hold-first".into()
    }
}

/// A worker woken while another's batch is in flight leaves the rows to that worker's
/// next claim only for a few milliseconds: a publish that hangs does not hold back what
/// is committed after it (the idle worker claims it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hanging_publish_does_not_hold_back_rows_committed_after_it() {
    let db = PgBackend::create("hold_first", DEFAULT_MAX).await;
    let store = db.store();
    let sink = std::sync::Arc::new(HoldFirst {
        seen: Default::default(),
        release: tokio::sync::Semaphore::new(0),
        first: std::sync::atomic::AtomicBool::new(true),
    });
    let mut cfg = relay_config("relay-hold-first");
    cfg.poll_interval = Duration::from_secs(60);
    cfg.in_flight_batches = 2;
    let handle = Relay::new(store.clone(), sink.clone(), cfg).spawn();
    // Started: its first claim found nothing.
    idle_after_claims(&handle, 1).await;
    let first = db.enqueue_all(&messages("t.hold.v1", 1)).await;
    // Waits until the sink was handed `id`.
    let seen = &sink.seen;
    let handed = |what: &'static str, id: uuid::Uuid| {
        crate::common::wait_until(what, Duration::from_secs(5), move || {
            let handed = seen.lock().unwrap().contains_key(&id);
            async move {
                if handed {
                    Ok(())
                } else {
                    Err("not handed yet".to_owned())
                }
            }
        })
    };
    handed("the first batch is held", first[0].message_id).await;
    let second = db.enqueue_all(&messages("t.hold.v1", 1)).await;
    handed(
        "the row committed after the held batch is published",
        second[0].message_id,
    )
    .await;
    // The later row settles while the first batch still hangs.
    crate::common::wait_until("the later row settled", Duration::from_secs(5), || {
        let dispatched = handle.stats().dispatched;
        async move {
            if dispatched == 1 {
                Ok(())
            } else {
                Err(format!("{dispatched} dispatched"))
            }
        }
    })
    .await;
    sink.release.add_permits(1);
    crate::common::wait_dispatched("both", &store, 2, Duration::from_secs(5)).await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, 2);
}
