//! The relay's log of a store outage: one WARN line when it begins and one INFO line when
//! it ends, carrying its start, end and length, the length measured from the first store
//! call that failed (whichever it was: here a settle) to the first that succeeded.

#![allow(clippy::unwrap_used)]

use crate::common::{capture_logs, messages, relay_config, sqlite_store};
use async_trait::async_trait;
use outbox::events::Enqueue as _;
use outbox::sink::{Confirmations, Sink};
use outbox::{OutgoingMessage, Relay, Store};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// How long the store is down, from the first publish on.
const OUTAGE: Duration = Duration::from_secs(3);

/// A real store whose every call fails (as a transient timeout) while `down` says so.
struct Flaky {
    inner: Arc<dyn Store>,
    /// When the outage began and ends; `None` before it.
    down: Arc<Mutex<Option<(Instant, Instant)>>>,
}

impl Flaky {
    fn check(&self) -> outbox::Result<()> {
        match *self.down.lock().unwrap() {
            Some((_, until)) if Instant::now() < until => {
                Err(outbox::Error::Timeout(Duration::from_secs(1)))
            }
            _ => Ok(()),
        }
    }
}

#[async_trait]
impl outbox::store::Relaying for Flaky {
    async fn check_schema(&self) -> outbox::Result<()> {
        self.check()?;
        self.inner.check_schema().await
    }
    async fn claim(
        &self,
        req: &outbox::store::ClaimRequest,
    ) -> outbox::Result<outbox::store::Claim> {
        self.check()?;
        self.inner.claim(req).await
    }
    async fn settle(
        &self,
        token: uuid::Uuid,
        s: &outbox::store::Settlement,
    ) -> outbox::Result<outbox::store::Settled> {
        self.check()?;
        self.inner.settle(token, s).await
    }
    async fn renew(
        &self,
        token: uuid::Uuid,
        ids: &[i64],
        lease: Duration,
    ) -> outbox::Result<Vec<i64>> {
        self.check()?;
        self.inner.renew(token, ids, lease).await
    }
    async fn pause_state(&self) -> outbox::Result<outbox::store::PauseState> {
        self.check()?;
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

#[async_trait]
impl outbox::store::Maintenance for Flaky {
    async fn migrate(&self) -> outbox::Result<()> {
        self.check()?;
        self.inner.migrate().await
    }
    async fn purge(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> outbox::Result<outbox::store::PurgeBatch> {
        self.check()?;
        self.inner.purge(older_than, batch_size).await
    }
    async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> outbox::Result<u64> {
        self.check()?;
        self.inner.inbox_purge(older_than, batch_size).await
    }
    async fn count_purgeable(&self, older_than: Duration) -> outbox::Result<u64> {
        self.check()?;
        self.inner.count_purgeable(older_than).await
    }
    async fn count_inbox_purgeable(&self, older_than: Duration) -> outbox::Result<u64> {
        self.check()?;
        self.inner.count_inbox_purgeable(older_than).await
    }
    async fn park_held(&self, ordering: &outbox::store::KeyOrdering) -> outbox::Result<u64> {
        self.check()?;
        self.inner.park_held(ordering).await
    }
    async fn unpark_released(&self, ordering: &outbox::store::KeyOrdering) -> outbox::Result<u64> {
        self.check()?;
        self.inner.unpark_released(ordering).await
    }
}

#[async_trait]
impl outbox::store::Registry for Flaky {
    async fn heartbeat(&self, beat: &outbox::store::RelayHeartbeat) -> outbox::Result<()> {
        self.check()?;
        self.inner.heartbeat(beat).await
    }
    async fn deregister(&self, relay_id: &str, instance: &str) -> outbox::Result<()> {
        self.check()?;
        self.inner.deregister(relay_id, instance).await
    }
    async fn relays(&self, within: Duration) -> outbox::Result<Vec<outbox::store::RelayRecord>> {
        self.check()?;
        self.inner.relays(within).await
    }
}

#[async_trait]
impl outbox::store::Operations for Flaky {
    async fn set_pause(&self, reason: Option<&str>) -> outbox::Result<()> {
        self.check()?;
        self.inner.set_pause(reason).await
    }
    async fn dead_letters(
        &self,
        selector: &outbox::store::DeadSelector,
        limit: u32,
        with_payload: bool,
    ) -> outbox::Result<Vec<outbox::store::DeadLetter>> {
        self.check()?;
        self.inner.dead_letters(selector, limit, with_payload).await
    }
    async fn count_dead(&self, selector: &outbox::store::DeadSelector) -> outbox::Result<u64> {
        self.check()?;
        self.inner.count_dead(selector).await
    }
    async fn replay(
        &self,
        request: &outbox::store::ReplayRequest,
    ) -> outbox::Result<outbox::store::ReplayOutcome> {
        self.check()?;
        self.inner.replay(request).await
    }
    async fn replays(&self, limit: u32) -> outbox::Result<Vec<outbox::store::ReplayRecord>> {
        self.check()?;
        self.inner.replays(limit).await
    }
    async fn pause_topic(
        &self,
        pattern: &outbox::sink::router::TopicPattern,
        reason: &str,
        by: &str,
    ) -> outbox::Result<()> {
        self.check()?;
        self.inner.pause_topic(pattern, reason, by).await
    }
    async fn resume_topic(&self, pattern: &str) -> outbox::Result<bool> {
        self.check()?;
        self.inner.resume_topic(pattern).await
    }
    async fn audit(&self, entry: &outbox::store::ops::AuditEntry) -> outbox::Result<()> {
        self.check()?;
        self.inner.audit(entry).await
    }
}

#[async_trait]
impl outbox::store::Views for Flaky {
    async fn counts(&self) -> outbox::Result<outbox::Counts> {
        self.check()?;
        self.inner.counts().await
    }
    async fn leases(&self) -> outbox::Result<outbox::store::Leases> {
        self.check()?;
        self.inner.leases().await
    }
    async fn overview(&self, top_n: u32) -> outbox::Result<outbox::store::Overview> {
        self.check()?;
        self.inner.overview(top_n).await
    }
    async fn held_keys(
        &self,
        ordering: &outbox::store::KeyOrdering,
    ) -> outbox::Result<outbox::store::HeldKeys> {
        self.check()?;
        self.inner.held_keys(ordering).await
    }
    async fn due_held_by_order(
        &self,
        ordering: &outbox::store::KeyOrdering,
    ) -> outbox::Result<outbox::store::DueHeld> {
        self.check()?;
        self.inner.due_held_by_order(ordering).await
    }
    async fn find_messages(
        &self,
        query: &outbox::store::lookup::MessageQuery,
        limit: u32,
    ) -> outbox::Result<Vec<outbox::store::lookup::MessageLocation>> {
        self.check()?;
        self.inner.find_messages(query, limit).await
    }
    async fn throughput(
        &self,
        minutes: u32,
    ) -> outbox::Result<Vec<outbox::store::lookup::MinuteCounts>> {
        self.check()?;
        self.inner.throughput(minutes).await
    }
}

/// Confirms every message, and takes the store down for [`OUTAGE`] at its first publish:
/// the batch's settle is the first call to fail.
struct TakesTheStoreDown {
    down: Arc<Mutex<Option<(Instant, Instant)>>>,
}

#[async_trait]
impl Sink for TakesTheStoreDown {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let mut down = self.down.lock().unwrap();
        if down.is_none() {
            let now = Instant::now();
            *down = Some((now, now + OUTAGE));
        }
        for i in 0..batch.len() {
            confirm.set(i, Ok(()));
        }
    }

    fn describe(&self) -> String {
        "takes the store down".into()
    }
}

/// A 3 s outage that begins with a failing settle and outlasts the lease (1 s), so the
/// settle gives up and only then do the claims fail: the length logged is the whole outage
/// (from the first failed call to the first that succeeded), not the part the claims saw;
/// one WARN line, one INFO line.
#[tokio::test] // current thread: the log capture follows this thread's tasks
async fn one_line_each_way_per_store_outage_with_its_whole_length() {
    let (logs, _guard) = capture_logs();
    let (lite, _dir) = sqlite_store().await;
    lite.enqueue_alone(&messages("outage.log", 1)[0])
        .await
        .unwrap();
    let lite: Arc<dyn Store> = Arc::new(lite);
    let down = Arc::new(Mutex::new(None));
    let store = Arc::new(Flaky {
        inner: lite,
        down: down.clone(),
    });
    let sink = Arc::new(TakesTheStoreDown { down: down.clone() });
    let mut cfg = relay_config("outage-log");
    cfg.lease = Duration::from_secs(1);
    // One worker: it settles (failing, until the lease would run out) before it claims.
    cfg.in_flight_batches = 1;
    let handle = Relay::new(store, sink, cfg).spawn();
    let text = || String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    crate::common::wait_until(
        "the end of the outage logged",
        Duration::from_secs(20),
        || {
            let t = text();
            async move {
                if t.contains("store reachable again") {
                    Ok(())
                } else {
                    Err(t)
                }
            }
        },
    )
    .await;
    let seen = Instant::now();
    handle.shutdown().await.unwrap();
    let text = text();
    let (began, _) = down.lock().unwrap().unwrap();
    let ended: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("store reachable again"))
        .collect();
    assert_eq!(ended.len(), 1, "{text}");
    let line = ended[0];
    assert!(
        line.contains(" INFO ") && line.contains("started=") && line.contains("ended="),
        "{line}"
    );
    let length_ms: u128 = line
        .split("length_ms=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    // The whole outage (it began at the first publish, before the settle), and no more
    // than the time from its start to the line.
    assert!(
        length_ms >= OUTAGE.as_millis() && length_ms <= (seen - began).as_millis() + 50,
        "length {length_ms} ms for a {OUTAGE:?} outage seen over {:?}:\n{text}",
        seen - began
    );
    // Once when it began: no line per retry, from the settle or the claims.
    let warns: Vec<&str> = text.lines().filter(|l| l.contains(" WARN ")).collect();
    assert_eq!(warns.len(), 1, "one WARN line for the outage:\n{text}");
    assert!(
        warns[0].contains("store outage") && warns[0].contains("started="),
        "{text}"
    );
}
