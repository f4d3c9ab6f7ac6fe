//! The store conformance suite: one body of cases, instantiated once per store by
//! [`conformance_cases!`] in `tests/conformance_postgres.rs`, `tests/conformance_mysql.rs`
//! and `tests/conformance_sqlite.rs`, so every case is its own `#[tokio::test]` per store.
//!
//! A case talks to the store through [`outbox::Store`] (what a relay uses) and to the
//! database through a [`Backend`]: the producer's side (enqueue is typed per store, inside a
//! transaction the case commits, rolls back or drops), raw SQL to look at rows, and the few
//! store-specific things a case needs (the SQL entry point for other languages, a bulk
//! insert, the claim's query plan, a lock held from outside).
//!
//! Each case asserts what the store contract promises (the guarantees and the row lifecycle
//! of ARCHITECTURE.md); where stores legitimately differ (SQLite has one writer, so a purge is never
//! locked out), the case asserts each store's own behaviour by [`Kind`].

// Each test binary instantiates one backend: the other stores' variants are unused there.

mod operations;
pub(crate) use operations::*;

use crate::common::{RecordingSink, Seen, messages, record, relay_config, total, wait_until};
use async_trait::async_trait;
use chrono::Utc;
use outbox::message::{Enqueued, Message, OutgoingMessage};
use outbox::sink::Confirmations;
use outbox::sink::{PublishError, Sink};
use outbox::store::{Claim, ClaimRequest, Dead, Retry, status};
use outbox::{Error, Relay, RelayError, Store};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// The default message size limit.
pub(crate) const DEFAULT_MAX: usize = outbox::store::DEFAULT_MAX_MESSAGE_BYTES;

/// Which store a backend drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Postgres,
    MySql,
    Sqlite,
}

/// How a producer transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    Commit,
    Rollback,
    /// Dropped without commit or rollback (an early return or a panic in the handler).
    Drop,
}

/// How [`Backend::try_produce`] runs one producer transaction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TxOpts {
    /// Insert business row `orders(id)` first, in the same transaction.
    pub(crate) business_row: Option<i64>,
    /// Run the transaction on a producer session whose time zone is far from UTC
    /// (PostgreSQL +14:00, MariaDB +13:00; SQLite has no session time zone).
    pub(crate) far_time_zone: bool,
    pub(crate) end: End,
}

impl Default for TxOpts {
    fn default() -> Self {
        TxOpts {
            business_row: None,
            far_time_zone: false,
            end: End::Commit,
        }
    }
}

/// One call of the store's SQL entry point for other languages.
#[derive(Debug, Clone)]
pub(crate) struct SqlCall {
    pub(crate) topic: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) key: Option<String>,
    /// `None`: the entry point makes a UUIDv7 (PostgreSQL and MariaDB; SQLite's documented
    /// INSERT needs one).
    pub(crate) message_id: Option<Uuid>,
    pub(crate) headers: serde_json::Value,
}

/// One row of the messages table with every column, times as microseconds since the Unix
/// epoch (UTC), so rows compare equal across reads and across stores.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    pub(crate) id: i64,
    pub(crate) message_id: Uuid,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: serde_json::Value,
    pub(crate) status: i16,
    pub(crate) attempts: i32,
    pub(crate) claimed_by: Option<String>,
    pub(crate) claim_token: Option<Uuid>,
    pub(crate) occurred_at: i64,
    pub(crate) available_at: i64,
    pub(crate) locked_until: Option<i64>,
    pub(crate) dispatched_at: Option<i64>,
    pub(crate) last_error: Option<String>,
}

/// A lock held from outside the store until [`Held::release`].
pub(crate) enum Held {
    Pg(sqlx::Transaction<'static, sqlx::Postgres>),
    MySql(sqlx::Transaction<'static, sqlx::MySql>),
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
}

impl Held {
    pub(crate) async fn release(self) {
        match self {
            Held::Pg(tx) => tx.rollback().await.unwrap(),
            Held::MySql(tx) => tx.rollback().await.unwrap(),
            Held::Sqlite(tx) => tx.rollback().await.unwrap(),
        }
    }
}

/// What a case needs from one store. Each implementation owns an isolated store (its own
/// PostgreSQL schema, MariaDB table prefix or SQLite file), migrated, with a business table
/// `orders (id, note)` beside it, and cleans it up when dropped.
#[async_trait]
pub(crate) trait Backend: Send + Sync + Sized + 'static {
    const KIND: Kind;

    /// A fresh migrated store whose `StoreConfig.max_message_bytes` is `max_message_bytes`.
    async fn create(label: &str, max_message_bytes: usize) -> Self;

    /// The store, as a relay sees it.
    fn store(&self) -> Arc<dyn Store>;

    /// One producer transaction on the application's own pool (not the store's): the
    /// business row when asked, then each message's enqueue (an error is kept and the
    /// transaction goes on), then the end. `Err` when the transaction itself failed (begin,
    /// business row, commit).
    async fn try_produce(
        &self,
        msgs: &[Message],
        opts: TxOpts,
    ) -> Result<Vec<outbox::Result<Enqueued>>, String>;

    /// Rows matching `filter` (a SQL condition every store understands), by id.
    async fn select_rows(&self, filter: &str) -> Vec<Row>;

    /// Rows of the messages table matching `filter`.
    async fn count(&self, filter: &str) -> i64;

    /// Business rows with this id.
    async fn orders(&self, id: i64) -> i64;

    /// The database clock, microseconds since the Unix epoch (UTC).
    async fn db_now_us(&self) -> i64;

    /// Sets `dispatched_at` and `occurred_at` of rows `ids` (whatever their status) to
    /// `ago` before the database clock's now.
    async fn set_dispatched_at_ago(&self, ids: &[i64], ago: Duration);

    /// Inserts `n` dispatched rows (dispatched `ago` before now) in bulk, with SQL.
    async fn bulk_insert_dispatched(&self, n: u64, ago: Duration);

    /// Refreshes the planner's statistics of the messages table.
    async fn analyze(&self);

    /// Asserts that the claim's query plan reads the live-row index, not the table; the
    /// query is checked against the store's source so the two stay in sync.
    async fn assert_claim_uses_live_index(&self);

    /// Holds, from another connection, a lock that makes a purge's delete wait.
    async fn hold_write_lock(&self) -> Held;

    /// Calls the store's SQL entry point once per call, all in one transaction, and
    /// returns each call's row id; `Err` (the transaction rolled back) on a database error.
    async fn sql_enqueue(&self, calls: &[SqlCall]) -> Result<Vec<i64>, String>;

    /// Enqueues `msg` in a transaction that stays open (holding the new row) until `gate`
    /// fires, then commits.
    async fn produce_held(
        &self,
        msg: &Message,
        gate: tokio::sync::oneshot::Receiver<()>,
    ) -> Enqueued;

    // -------------------------------------------------------------------- provided

    async fn produce(&self, msgs: &[Message], opts: TxOpts) -> Vec<outbox::Result<Enqueued>> {
        self.try_produce(msgs, opts).await.unwrap()
    }

    /// Enqueues `msgs` in one committed transaction; every enqueue must succeed.
    async fn enqueue_all(&self, msgs: &[Message]) -> Vec<Enqueued> {
        self.produce(msgs, TxOpts::default())
            .await
            .into_iter()
            .map(|r| r.unwrap())
            .collect()
    }

    async fn rows_of(&self, ids: &[i64]) -> Vec<Row> {
        if ids.is_empty() {
            return Vec::new();
        }
        self.select_rows(&id_filter(ids)).await
    }

    async fn row(&self, id: i64) -> Row {
        self.rows_of(&[id])
            .await
            .pop()
            .unwrap_or_else(|| panic!("no row {id}"))
    }
}

/// `id IN (…)`.
pub(crate) fn id_filter(ids: &[i64]) -> String {
    let list: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!("id IN ({})", list.join(","))
}

/// The SQL text of `source` with runs of whitespace made one space.
pub(crate) fn squash(source: &str) -> String {
    source.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Panics unless the store's `source` contains `query` (whitespace aside): the suite's
/// copy of a store query must follow the store.
pub(crate) fn assert_in_source(source: &str, query: &str, store_file: &str) {
    assert!(
        squash(source).contains(&squash(query)),
        "the store's query changed: {store_file} no longer contains\n  {query}\nupdate the \
         conformance suite's copy to the store's new query"
    );
}

fn us(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap()
}

async fn claim(store: &Arc<dyn Store>, relay: &str, batch: u32, lease: Duration) -> Claim {
    store
        .claim(&ClaimRequest {
            relay_id: relay.to_owned(),
            batch_size: batch,
            lease,
            skip_topics: Vec::new(),
        })
        .await
        .unwrap()
}

fn claim_ids(c: &Claim) -> Vec<i64> {
    c.messages.iter().map(|m| m.id).collect()
}

async fn wait_dispatched(store: &Arc<dyn Store>, n: i64, timeout: Duration) {
    let s = store.clone();
    wait_until(&format!("{n} rows dispatched"), timeout, || {
        let s = s.clone();
        async move {
            let c = s.counts().await.unwrap();
            if c.dispatched == n {
                Ok(())
            } else {
                Err(format!("{c:?}"))
            }
        }
    })
    .await;
}

const LONG: Duration = Duration::from_secs(60);

// ======================================================================================
// 1. Row lifecycle
// ======================================================================================

/// pending → claim (status 1, attempts 1, token, lease on the database clock) → mark (2);
/// transient → reschedule (0, due after the delay on the database clock, last_error);
/// permanent → dead (3); release gives the claim's attempt back and makes the row due now.
pub(crate) async fn row_lifecycle<B: Backend>() {
    let b = B::create("life", DEFAULT_MAX).await;
    let store = b.store();
    let msgs = messages("t.life.v1", 4);
    let enq = b.enqueue_all(&msgs).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();
    assert!(enq.iter().all(|e| e.inserted));
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids grow: {ids:?}");
    let (a, bb, c, d) = (ids[0], ids[1], ids[2], ids[3]);

    let now = b.db_now_us().await;
    for r in b.rows_of(&ids).await {
        assert_eq!((r.status, r.attempts), (status::PENDING, 0), "{r:?}");
        assert_eq!(r.claimed_by, None);
        assert_eq!(r.claim_token, None);
        assert_eq!(r.locked_until, None);
        assert_eq!(r.dispatched_at, None);
        assert_eq!(r.last_error, None);
        assert!(r.available_at <= now, "a new row is due at once: {r:?}");
        assert!(
            r.occurred_at <= now && r.occurred_at > now - 10_000_000,
            "{r:?}"
        );
    }

    // Claim: all four, in id order, attempt counted, token and lease written.
    let t0 = b.db_now_us().await;
    // A relay id with quotes, a backslash and non-ASCII text: stored as given.
    let relay = "relay-ä 'a\\\"b";
    let first = claim(&store, relay, 10, Duration::from_secs(30)).await;
    let t1 = b.db_now_us().await;
    assert_eq!(claim_ids(&first), ids);
    assert!(first.malformed.is_empty());
    for (m, sent) in first.messages.iter().zip(&msgs) {
        assert_eq!(m.attempts, 1);
        assert_eq!(m.message_id, sent.id());
        assert_eq!(m.topic, "t.life.v1");
        assert_eq!(&m.payload[..], sent.payload());
    }
    for r in b.rows_of(&ids).await {
        assert_eq!((r.status, r.attempts), (status::CLAIMED, 1), "{r:?}");
        assert_eq!(r.claim_token, Some(first.token));
        assert_eq!(r.claimed_by.as_deref(), Some(relay));
        let lease = r.locked_until.unwrap();
        assert!(
            lease >= t0 + us(Duration::from_secs(30)) - 1_000
                && lease <= t1 + us(Duration::from_secs(30)) + 1_000,
            "locked_until = now + lease on the database clock: {lease} vs [{t0}, {t1}] + 30 s"
        );
    }
    // Held rows are not claimable.
    assert!(claim(&store, "relay-b", 10, LONG).await.messages.is_empty());

    // Mark: dispatched, token and lease cleared.
    assert_eq!(store.mark_dispatched(first.token, &[a]).await.unwrap(), 1);
    let t2 = b.db_now_us().await;
    let ra = b.row(a).await;
    assert_eq!((ra.status, ra.attempts), (status::DISPATCHED, 1), "{ra:?}");
    let at = ra.dispatched_at.unwrap();
    assert!(at >= t1 - 1_000 && at <= t2 + 1_000, "{at} vs [{t1}, {t2}]");
    assert_eq!(
        (ra.claim_token, ra.locked_until, ra.last_error),
        (None, None, None)
    );

    // Transient failure: pending again, due after the delay on the database clock.
    let delay = Duration::from_secs(5);
    let t3 = b.db_now_us().await;
    let n = store
        .reschedule(
            first.token,
            &[Retry {
                id: bb,
                delay,
                error: "broker busy".into(),
                refund_attempt: false,
            }],
        )
        .await
        .unwrap();
    let t4 = b.db_now_us().await;
    assert_eq!(n, 1);
    let rb = b.row(bb).await;
    assert_eq!((rb.status, rb.attempts), (status::PENDING, 1), "{rb:?}");
    assert_eq!(rb.last_error.as_deref(), Some("broker busy"));
    assert_eq!((rb.claim_token, rb.locked_until), (None, None));
    assert!(
        rb.available_at >= t3 + us(delay) - 1_000 && rb.available_at <= t4 + us(delay) + 1_000,
        "available_at = now + delay: {} vs [{t3}, {t4}] + 5 s",
        rb.available_at
    );

    // Permanent failure: dead, with the reason.
    let n = store
        .quarantine(
            first.token,
            &[Dead {
                id: c,
                error: "permanent: unroutable".into(),
            }],
        )
        .await
        .unwrap();
    assert_eq!(n, 1);
    let rc = b.row(c).await;
    assert_eq!((rc.status, rc.attempts), (status::DEAD, 1), "{rc:?}");
    assert_eq!(rc.last_error.as_deref(), Some("permanent: unroutable"));
    assert_eq!((rc.claim_token, rc.locked_until), (None, None));

    // Release (graceful shutdown): pending, attempt given back, due now.
    let t5 = b.db_now_us().await;
    assert_eq!(store.release(first.token, &[d]).await.unwrap(), 1);
    let t6 = b.db_now_us().await;
    let rd = b.row(d).await;
    assert_eq!((rd.status, rd.attempts), (status::PENDING, 0), "{rd:?}");
    assert_eq!((rd.claim_token, rd.locked_until), (None, None));
    assert!(
        rd.available_at >= t5 - 1_000 && rd.available_at <= t6 + 1_000,
        "a released row is due now: {} vs [{t5}, {t6}]",
        rd.available_at
    );

    // Settled rows: the same token changes nothing any more.
    let snapshot = b.rows_of(&ids).await;
    assert_eq!(store.mark_dispatched(first.token, &ids).await.unwrap(), 0);
    assert_eq!(store.release(first.token, &ids).await.unwrap(), 0);
    let retries: Vec<Retry> = ids
        .iter()
        .map(|&id| Retry {
            id,
            delay: Duration::ZERO,
            error: "x".into(),
            refund_attempt: false,
        })
        .collect();
    assert_eq!(store.reschedule(first.token, &retries).await.unwrap(), 0);
    let dead: Vec<Dead> = ids
        .iter()
        .map(|&id| Dead {
            id,
            error: "x".into(),
        })
        .collect();
    assert_eq!(store.quarantine(first.token, &dead).await.unwrap(), 0);
    assert_eq!(b.rows_of(&ids).await, snapshot);
    let counts = store.counts().await.unwrap();
    assert_eq!(
        (
            counts.pending,
            counts.claimed,
            counts.dispatched,
            counts.dead
        ),
        (2, 0, 1, 1),
        "{counts:?}"
    );

    // Only the released row is due (the rescheduled one waits for its backoff).
    let second = claim(&store, "relay-c", 10, LONG).await;
    assert_eq!(claim_ids(&second), vec![d]);
    assert_eq!(second.messages[0].attempts, 1);
    store
        .reschedule(
            second.token,
            &[Retry {
                id: d,
                delay: Duration::ZERO,
                error: "again".into(),
                refund_attempt: false,
            }],
        )
        .await
        .unwrap();
    let third = claim(&store, "relay-c", 10, LONG).await;
    assert_eq!(claim_ids(&third), vec![d]);
    assert_eq!(
        third.messages[0].attempts, 2,
        "a retried attempt stays counted"
    );
    assert_eq!(store.release(third.token, &[d]).await.unwrap(), 1);
    let rd = b.row(d).await;
    assert_eq!(
        (rd.status, rd.attempts),
        (status::PENDING, 1),
        "release gives back only the released claim's attempt: {rd:?}"
    );
    assert_eq!(rd.last_error.as_deref(), Some("again"));
}

// ======================================================================================
// 2. Concurrent claimers
// ======================================================================================

/// Six claimers loop claim → mark over thousands of rows while a producer adds more: no
/// row is ever in two claims (with a lease longer than the test, each id is claimed exactly
/// once), and every row ends dispatched.
pub(crate) async fn concurrent_claimers_never_overlap<B: Backend>() {
    const BACKLOG: usize = 2_000;
    const LATE: usize = 1_000;
    const CLAIMERS: usize = 6;
    let b = Arc::new(B::create("conc", DEFAULT_MAX).await);
    let store = b.store();
    let mut expected: HashSet<i64> = HashSet::new();
    for chunk in messages("t.conc.v1", BACKLOG).chunks(500) {
        expected.extend(b.enqueue_all(chunk).await.iter().map(|e| e.id));
    }

    let producing = Arc::new(AtomicBool::new(true));
    let producer = {
        let (b, producing) = (b.clone(), producing.clone());
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for chunk in messages("t.conc.v1", LATE).chunks(50) {
                ids.extend(b.enqueue_all(chunk).await.iter().map(|e| e.id));
            }
            producing.store(false, Ordering::SeqCst);
            ids
        })
    };
    let claimed: Arc<Mutex<HashMap<i64, u32>>> = Arc::default();
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|i| {
            let (store, claimed, producing) = (store.clone(), claimed.clone(), producing.clone());
            tokio::spawn(async move {
                let mut mine = 0usize;
                loop {
                    // Read the flag before claiming: once the producer is done and a claim
                    // finds nothing, every committed row was claimed by someone.
                    let done = !producing.load(Ordering::SeqCst);
                    let c = store
                        .claim(&ClaimRequest {
                            relay_id: format!("claimer-{i}"),
                            batch_size: 50,
                            lease: LONG,
                            skip_topics: Vec::new(),
                        })
                        .await
                        .unwrap_or_else(|e| panic!("claimer-{i}: claim failed: {e}"));
                    if c.messages.is_empty() {
                        if done {
                            return mine;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    let ids = claim_ids(&c);
                    {
                        let mut map = claimed.lock().unwrap();
                        for id in &ids {
                            *map.entry(*id).or_insert(0) += 1;
                        }
                    }
                    mine += ids.len();
                    let n = store
                        .mark_dispatched(c.token, &ids)
                        .await
                        .unwrap_or_else(|e| panic!("claimer-{i}: mark failed: {e}"));
                    assert_eq!(n, ids.len() as u64, "claimer-{i} lost rows of its claim");
                }
            })
        })
        .collect();
    expected.extend(producer.await.unwrap());
    let mut per_claimer = Vec::new();
    for c in claimers {
        per_claimer.push(c.await.unwrap());
    }
    let total_rows = BACKLOG + LATE;
    assert_eq!(expected.len(), total_rows);
    let claimed = claimed.lock().unwrap().clone();
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "rows claimed more than once: {twice:?}");
    let claimed_ids: HashSet<i64> = claimed.keys().copied().collect();
    assert_eq!(claimed_ids, expected, "every row claimed");
    assert!(
        per_claimer.iter().filter(|n| **n > 0).count() >= 2,
        "the claimers did not really compete: {per_claimer:?}"
    );
    let c = store.counts().await.unwrap();
    assert_eq!(
        (c.pending, c.claimed, c.dispatched, c.dead),
        (0, 0, total_rows as i64, 0),
        "{c:?}"
    );
    assert_eq!(b.count("attempts <> 1").await, 0, "a row was claimed twice");
}

// ======================================================================================
// 3. Lease expiry and the stale claimant
// ======================================================================================

/// A claim with a short lease that is never settled: while it holds, nobody else gets the
/// rows; after it, another claim does (attempt 2), and the stale claimant's mark,
/// reschedule, quarantine and release each change nothing.
pub(crate) async fn expired_lease_fences_the_stale_claimant<B: Backend>() {
    let b = B::create("stale", DEFAULT_MAX).await;
    let store = b.store();
    let enq = b.enqueue_all(&messages("t.stale.v1", 3)).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();

    let old = claim(&store, "relay-old", 10, Duration::from_secs(1)).await;
    assert_eq!(claim_ids(&old), ids);
    let during = claim(&store, "relay-eager", 10, LONG).await;
    assert!(
        during.messages.is_empty(),
        "claims overlapped while the lease held"
    );

    tokio::time::sleep(Duration::from_millis(1200)).await;
    let new = claim(&store, "relay-new", 10, LONG).await;
    assert_ne!(new.token, old.token);
    assert_eq!(claim_ids(&new), ids, "expired claims come back");
    assert!(
        new.messages.iter().all(|m| m.attempts == 2),
        "the expired claim's attempt stays counted"
    );

    let before = b.rows_of(&ids).await;
    for r in &before {
        assert_eq!(r.status, status::CLAIMED);
        assert_eq!(r.claimed_by.as_deref(), Some("relay-new"));
        assert_eq!(r.claim_token, Some(new.token));
    }

    // Every update by the stale token is a no-op: 0 rows, and no column changes.
    assert_eq!(store.mark_dispatched(old.token, &ids).await.unwrap(), 0);
    assert_eq!(b.rows_of(&ids).await, before, "stale mark changed rows");
    let retries: Vec<Retry> = ids
        .iter()
        .map(|&id| Retry {
            id,
            delay: Duration::from_secs(60),
            error: "stale retry".into(),
            refund_attempt: false,
        })
        .collect();
    assert_eq!(store.reschedule(old.token, &retries).await.unwrap(), 0);
    assert_eq!(
        b.rows_of(&ids).await,
        before,
        "stale reschedule changed rows"
    );
    let dead: Vec<Dead> = ids
        .iter()
        .map(|&id| Dead {
            id,
            error: "stale kill".into(),
        })
        .collect();
    assert_eq!(store.quarantine(old.token, &dead).await.unwrap(), 0);
    assert_eq!(
        b.rows_of(&ids).await,
        before,
        "stale quarantine changed rows"
    );
    assert_eq!(store.release(old.token, &ids).await.unwrap(), 0);
    assert_eq!(b.rows_of(&ids).await, before, "stale release changed rows");

    // The owner's updates work, one of each.
    assert_eq!(
        store.mark_dispatched(new.token, &ids[..1]).await.unwrap(),
        1
    );
    let retry = Retry {
        id: ids[1],
        delay: Duration::from_secs(60),
        error: "try later".into(),
        refund_attempt: false,
    };
    assert_eq!(store.reschedule(new.token, &[retry]).await.unwrap(), 1);
    let kill = Dead {
        id: ids[2],
        error: "poison".into(),
    };
    assert_eq!(store.quarantine(new.token, &[kill]).await.unwrap(), 1);
    let after = b.rows_of(&ids).await;
    assert_eq!(after[0].status, status::DISPATCHED);
    assert_eq!(after[1].status, status::PENDING);
    assert_eq!(after[1].last_error.as_deref(), Some("try later"));
    assert_eq!(after[2].status, status::DEAD);
    assert_eq!(after[2].last_error.as_deref(), Some("poison"));
    assert!(after.iter().all(|r| r.claim_token.is_none()));
    // The stale token still changes nothing after the owner settled.
    assert_eq!(store.mark_dispatched(old.token, &ids).await.unwrap(), 0);
    assert_eq!(store.release(old.token, &ids).await.unwrap(), 0);
    assert_eq!(b.rows_of(&ids).await, after);
}

// ======================================================================================
// 4. The database clock
// ======================================================================================

/// Claims `store` every 20 ms until every id in `waiting` has been claimed (marking each
/// claim at once), and returns when each was first claimed, measured from `start`.
async fn first_claimed(
    store: &Arc<dyn Store>,
    waiting: &[i64],
    start: Instant,
    timeout: Duration,
) -> HashMap<i64, Duration> {
    let mut got = HashMap::new();
    while got.len() < waiting.len() {
        assert!(
            start.elapsed() < timeout,
            "rows {waiting:?} not all claimable after {timeout:?}; got {got:?}"
        );
        let c = claim(store, "relay-clock", 100, LONG).await;
        let at = start.elapsed();
        for m in &c.messages {
            if waiting.contains(&m.id) {
                got.entry(m.id).or_insert(at);
            }
        }
        // Mark what came back so it does not come back again.
        store
            .mark_dispatched(c.token, &claim_ids(&c))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    got
}

/// Every eligibility comparison runs on the database clock in UTC: a producer whose session
/// time zone is far from UTC (PostgreSQL +14:00, MariaDB +13:00) enqueues a message that is
/// due at once (not 14 hours late or early); `Message::delay` and `Message::available_at`
/// hold a message back by their time only; a reschedule's delay holds a row back by its
/// delay only. SQLite has no session time zone: its times must be UTC milliseconds.
///
/// Relay clock skew needs no case of its own: the relay never sends a timestamp to the
/// store (claims, leases, backoffs and purges send durations; every `now` is the
/// database's), so a relay's clock cannot move any of these times.
pub(crate) async fn database_clock_decides_eligibility<B: Backend>() {
    let b = B::create("clock", DEFAULT_MAX).await;
    let store = b.store();
    let delay = Duration::from_secs(2);
    let start = Instant::now();
    let absolute = Utc::now() + chrono::Duration::from_std(delay).unwrap();
    let msgs = vec![
        Message::new("t.clock.v1", b"now".to_vec()),
        Message::new("t.clock.v1", b"delayed".to_vec()).delay(delay),
        Message::new("t.clock.v1", b"at".to_vec()).available_at(absolute),
    ];
    let enq: Vec<Enqueued> = b
        .produce(
            &msgs,
            TxOpts {
                far_time_zone: true,
                ..TxOpts::default()
            },
        )
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();

    // Stored times are UTC, whatever the producer's session time zone.
    let wall = Utc::now().timestamp_micros();
    for r in b.rows_of(&ids).await {
        assert!(
            (r.occurred_at - wall).abs() < 5_000_000,
            "occurred_at {} is not the UTC time {wall} (off by {} s)",
            r.occurred_at,
            (r.occurred_at - wall) / 1_000_000
        );
    }
    let rows = b.rows_of(&ids).await;
    assert!(
        (rows[2].available_at - absolute.timestamp_micros()).abs() <= 1_000,
        "available_at is kept as given (UTC): {} vs {}",
        rows[2].available_at,
        absolute.timestamp_micros()
    );

    // Due at once: only the undelayed message.
    let now_claim = claim(&store, "relay-clock", 100, LONG).await;
    assert_eq!(
        claim_ids(&now_claim),
        vec![ids[0]],
        "the undelayed message must be due at once, the delayed ones not yet"
    );
    let got = first_claimed(&store, &ids[1..], start, Duration::from_secs(6)).await;
    for id in &ids[1..] {
        let at = got[id];
        assert!(
            at >= delay - Duration::from_millis(50),
            "row {id} claimable after {at:?}, before its {delay:?} delay"
        );
        assert!(
            at < delay + Duration::from_millis(1500),
            "row {id} claimable only after {at:?}, its delay was {delay:?}"
        );
    }

    // A reschedule's delay is on the database clock as well.
    let retry_delay = Duration::from_millis(1500);
    let again = b
        .enqueue_all(&[Message::new("t.clock.v1", b"retry".to_vec())])
        .await;
    let c = claim(&store, "relay-clock", 100, LONG).await;
    assert_eq!(claim_ids(&c), vec![again[0].id]);
    let start = Instant::now();
    let retry = Retry {
        id: again[0].id,
        delay: retry_delay,
        error: "transient".into(),
        refund_attempt: false,
    };
    assert_eq!(store.reschedule(c.token, &[retry]).await.unwrap(), 1);
    assert!(
        claim(&store, "relay-clock", 100, LONG)
            .await
            .messages
            .is_empty(),
        "a rescheduled row is not due before its delay"
    );
    let got = first_claimed(&store, &[again[0].id], start, Duration::from_secs(5)).await;
    let at = got[&again[0].id];
    assert!(
        at >= retry_delay - Duration::from_millis(50),
        "claimable after {at:?}, before the {retry_delay:?} backoff"
    );
    assert!(
        at < retry_delay + Duration::from_millis(1500),
        "claimable only after {at:?}, the backoff was {retry_delay:?}"
    );
}

// ======================================================================================
// 5. Poison messages
// ======================================================================================

/// Fails `permanent` with a permanent error and `transient` with a transient one, always;
/// confirms everything else. Counts every message it is handed.
struct Poisoned {
    inner: Arc<RecordingSink>,
    permanent: Uuid,
    transient: Uuid,
    handed: Seen,
}

#[async_trait]
impl Sink for Poisoned {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async {
            record(&self.handed, batch);
            let healthy: Vec<OutgoingMessage> = batch
                .iter()
                .filter(|m| m.message_id != self.permanent && m.message_id != self.transient)
                .cloned()
                .collect();
            let mut inner = self.inner.publish_all(&healthy).await.into_iter();
            batch
                .iter()
                .map(|m| {
                    if m.message_id == self.permanent {
                        Err(PublishError::permanent(
                            "broker refused: unauthorised topic",
                        ))
                    } else if m.message_id == self.transient {
                        Err(PublishError::transient("broker busy, try later"))
                    } else {
                        inner.next().unwrap()
                    }
                })
                .collect()
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }

    fn describe(&self) -> String {
        "poisoned".into()
    }
}

/// A relay (max_attempts 3) over a queue headed by a permanently failing and a forever
/// transiently failing message: the first is dead after 1 attempt, the second after 3,
/// and every row behind them is dispatched once.
pub(crate) async fn poison_is_bounded_and_later_rows_flow<B: Backend>() {
    let b = B::create("poison", DEFAULT_MAX).await;
    let store = b.store();
    let permanent = Message::new("t.poison.v1", b"perm".to_vec());
    let transient = Message::new("t.poison.v1", b"trans".to_vec());
    let mut msgs = vec![permanent.clone(), transient.clone()];
    msgs.extend(messages("t.poison.v1", 20));
    let enq = b.enqueue_all(&msgs).await;

    let (inner, delivered) = RecordingSink::new();
    let handed: Seen = Arc::default();
    let sink = Arc::new(Poisoned {
        inner,
        permanent: permanent.id(),
        transient: transient.id(),
        handed: handed.clone(),
    });
    let mut cfg = relay_config("relay-poison");
    cfg.max_attempts = 3;
    cfg.batch_size = 8;
    cfg.backoff_base = Duration::from_millis(50);
    cfg.backoff_max = Duration::from_millis(100);
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    // Rows enqueued while the poison is being retried flow too.
    let late = b.enqueue_all(&messages("t.poison.v1", 5)).await;
    let s = store.clone();
    wait_until(
        "healthy rows dispatched, 2 dead",
        Duration::from_secs(15),
        || {
            let s = s.clone();
            async move {
                let c = s.counts().await.unwrap();
                if c.dispatched == 25 && c.dead == 2 && c.pending == 0 && c.claimed == 0 {
                    Ok(())
                } else {
                    Err(format!("{c:?}"))
                }
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.quarantined, 2, "{stats:?}");
    assert_eq!(stats.retried, 2, "{stats:?}");
    assert_eq!(stats.dispatched, 25, "{stats:?}");

    let perm = b.row(enq[0].id).await;
    assert_eq!((perm.status, perm.attempts), (status::DEAD, 1), "{perm:?}");
    let e = perm.last_error.unwrap();
    assert!(e.contains("unauthorised topic"), "{e}");
    let trans = b.row(enq[1].id).await;
    assert_eq!(
        (trans.status, trans.attempts),
        (status::DEAD, 3),
        "{trans:?}"
    );
    let e = trans.last_error.unwrap();
    assert!(
        e.contains("broker busy, try later") && e.contains("3 attempts"),
        "{e}"
    );

    let handed = handed.lock().unwrap().clone();
    assert_eq!(handed[&permanent.id()], 1);
    assert_eq!(handed[&transient.id()], 3);
    let delivered = delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), 25);
    for e in enq.iter().skip(2).chain(&late) {
        assert_eq!(delivered.get(&e.message_id), Some(&1));
    }
    assert_eq!(b.count("1 = 1").await, 27, "dead rows are kept for replay");
}

/// A message whose every claim ends without an outcome (it crashes the relay) is
/// quarantined once its claims exceed `max_attempts`, without being published again.
pub(crate) async fn crash_looping_claims_are_bounded<B: Backend>() {
    let b = B::create("crashloop", DEFAULT_MAX).await;
    let store = b.store();
    let enq = b.enqueue_all(&messages("t.crashloop.v1", 1)).await;
    for i in 0..2 {
        let c = claim(
            &store,
            &format!("crashed-{i}"),
            10,
            Duration::from_millis(300),
        )
        .await;
        assert_eq!(c.messages.len(), 1);
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let (sink, seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-survivor");
    cfg.max_attempts = 2;
    cfg.drain = true;
    let stats = Relay::new(store.clone(), sink, cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(stats.quarantined, 1, "{stats:?}");
    assert!(
        seen.lock().unwrap().is_empty(),
        "published past max_attempts"
    );
    let r = b.row(enq[0].id).await;
    assert_eq!((r.status, r.attempts), (status::DEAD, 3), "{r:?}");
    let e = r.last_error.unwrap();
    assert!(e.contains("exceeds max_attempts 2"), "{e}");
}

// ======================================================================================
// 6. Purge
// ======================================================================================

/// Purge deletes dispatched rows older than the retention, at most `batch_size` per call;
/// pending, claimed and dead rows (even with an old `dispatched_at`) and young dispatched
/// rows are untouched. One purger at a time: a second one is locked out on PostgreSQL and
/// MariaDB, and waits on SQLite (one writer). Producers inserting while purges run never
/// see an error (no deadlock or lock wait timeout on MariaDB).
pub(crate) async fn purge_deletes_old_dispatched_rows_in_bounded_batches<B: Backend>() {
    let b = Arc::new(B::create("purge", DEFAULT_MAX).await);
    let store = b.store();
    let hour = Duration::from_secs(3600);

    // 250 old dispatched, 10 young dispatched, 5 pending (in backoff), 5 claimed, 5 dead.
    let enq = b.enqueue_all(&messages("t.purge.v1", 275)).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();
    let c = claim(&store, "relay-purge", 300, Duration::from_secs(600)).await;
    assert_eq!(c.messages.len(), 275);
    let (old, rest) = ids.split_at(250);
    let (young, rest) = rest.split_at(10);
    let (pending, rest) = rest.split_at(5);
    let (claimed, dead) = rest.split_at(5);
    assert_eq!(store.mark_dispatched(c.token, old).await.unwrap(), 250);
    assert_eq!(store.mark_dispatched(c.token, young).await.unwrap(), 10);
    let retries: Vec<Retry> = pending
        .iter()
        .map(|&id| Retry {
            id,
            delay: hour,
            error: "later".into(),
            refund_attempt: false,
        })
        .collect();
    assert_eq!(store.reschedule(c.token, &retries).await.unwrap(), 5);
    let kills: Vec<Dead> = dead
        .iter()
        .map(|&id| Dead {
            id,
            error: "dead".into(),
        })
        .collect();
    assert_eq!(store.quarantine(c.token, &kills).await.unwrap(), 5);
    // Old rows are old; so (as far as their times go) are the rows purge must not touch.
    let mut aged: Vec<i64> = old.to_vec();
    aged.extend(pending.iter().chain(claimed).chain(dead));
    b.set_dispatched_at_ago(&aged, 2 * hour).await;
    let untouchable: Vec<i64> = young
        .iter()
        .chain(pending)
        .chain(claimed)
        .chain(dead)
        .copied()
        .collect();
    let keep = b.rows_of(&untouchable).await;

    let mut deleted = Vec::new();
    loop {
        let r = store.purge(hour, 100).await.unwrap();
        assert!(!r.locked_out, "a lone purger is never locked out");
        deleted.push(r.deleted);
        if r.deleted < 100 {
            break;
        }
    }
    assert_eq!(deleted, vec![100, 100, 50], "batch size respected per call");
    let r = store.purge(hour, 100).await.unwrap();
    assert_eq!((r.deleted, r.locked_out), (0, false), "nothing old is left");
    assert_eq!(
        b.rows_of(&untouchable).await,
        keep,
        "purge touched other rows"
    );
    assert_eq!(b.count("1 = 1").await, 25);

    // Two purgers at once: the first waits on a lock held from outside, mid-delete.
    b.bulk_insert_dispatched(2_000, 2 * hour).await;
    let held = b.hold_write_lock().await;
    let first = {
        let store = store.clone();
        tokio::spawn(async move { store.purge(hour, 500).await.unwrap() })
    };
    // Time for the first purger to take the purge lock and reach the held lock.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !first.is_finished(),
        "the first purge should wait on the held lock"
    );
    let second = {
        let store = store.clone();
        tokio::spawn(async move { store.purge(hour, 500).await.unwrap() })
    };
    match B::KIND {
        Kind::Postgres | Kind::MySql => {
            // Answers at once, while the first purger still holds the purge lock.
            let r = tokio::time::timeout(Duration::from_secs(5), second)
                .await
                .expect("a second purger must not wait for the first")
                .unwrap();
            assert!(!first.is_finished());
            assert!(r.locked_out, "a second purger is locked out: {r:?}");
            assert_eq!(r.deleted, 0);
            held.release().await;
            let r = first.await.unwrap();
            assert_eq!((r.deleted, r.locked_out), (500, false));
        }
        Kind::Sqlite => {
            // One writer at a time: the second purge queues behind the first.
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(
                !second.is_finished(),
                "SQLite purges wait for the write lock"
            );
            held.release().await;
            let r1 = first.await.unwrap();
            let r2 = second.await.unwrap();
            assert_eq!((r1.deleted, r1.locked_out), (500, false));
            assert_eq!((r2.deleted, r2.locked_out), (500, false));
        }
    }
    assert_eq!(b.rows_of(&untouchable).await, keep);

    // Purge at full retention speed while two producers insert and a claimer marks, ~3 s.
    let deadline = Instant::now() + Duration::from_secs(3);
    let running = Arc::new(AtomicBool::new(true));
    let producers: Vec<_> = (0..2)
        .map(|p| {
            let b = b.clone();
            tokio::spawn(async move {
                let mut produced = Vec::new();
                let mut errors = Vec::new();
                while Instant::now() < deadline {
                    let msgs = messages(&format!("t.purge.p{p}"), 20);
                    match b.try_produce(&msgs, TxOpts::default()).await {
                        Ok(results) => {
                            for r in results {
                                match r {
                                    Ok(e) => produced.push(e.message_id),
                                    Err(e) => errors.push(e.to_string()),
                                }
                            }
                        }
                        Err(e) => errors.push(e),
                    }
                }
                (produced, errors)
            })
        })
        .collect();
    let claimer = {
        let (store, running) = (store.clone(), running.clone());
        tokio::spawn(async move {
            let mut marked = Vec::new();
            loop {
                let done = !running.load(Ordering::SeqCst);
                let c = store
                    .claim(&ClaimRequest {
                        relay_id: "relay-purge".into(),
                        batch_size: 100,
                        lease: LONG,
                        skip_topics: Vec::new(),
                    })
                    .await
                    .unwrap_or_else(|e| panic!("claim failed: {e}"));
                if c.messages.is_empty() {
                    if done {
                        return marked;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                let n = store
                    .mark_dispatched(c.token, &claim_ids(&c))
                    .await
                    .unwrap_or_else(|e| panic!("mark failed: {e}"));
                assert_eq!(n, c.messages.len() as u64);
                marked.extend(c.messages.iter().map(|m| m.message_id));
            }
        })
    };
    let purgers: Vec<_> = (0..2)
        .map(|_| {
            let (store, running) = (store.clone(), running.clone());
            tokio::spawn(async move {
                let (mut deleted, mut locked_out, mut errors) = (0u64, 0u32, Vec::new());
                while running.load(Ordering::SeqCst) {
                    match store.purge(Duration::ZERO, 200).await {
                        Ok(r) => {
                            assert!(r.deleted <= 200, "batch size exceeded: {r:?}");
                            deleted += r.deleted;
                            locked_out += u32::from(r.locked_out);
                            if r.deleted == 0 {
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                }
                (deleted, locked_out, errors)
            })
        })
        .collect();
    let mut produced = HashSet::new();
    let mut producer_errors = Vec::new();
    for p in producers {
        let (ids, errors) = p.await.unwrap();
        produced.extend(ids);
        producer_errors.extend(errors);
    }
    running.store(false, Ordering::SeqCst);
    let marked = claimer.await.unwrap();
    let (mut purge_errors, mut locked_out) = (Vec::new(), 0);
    for p in purgers {
        let (_, l, e) = p.await.unwrap();
        locked_out += l;
        purge_errors.extend(e);
    }
    eprintln!(
        "{:?}: {} messages produced during purges; second purger locked out {locked_out} times",
        B::KIND,
        produced.len()
    );
    assert!(
        producer_errors.is_empty(),
        "producers saw errors while purges ran: {producer_errors:?}"
    );
    assert!(purge_errors.is_empty(), "purge errors: {purge_errors:?}");
    assert!(!produced.is_empty());
    if B::KIND == Kind::Sqlite {
        assert_eq!(
            locked_out, 0,
            "SQLite purges wait for the write lock instead"
        );
    }
    let marked_set: HashSet<Uuid> = marked.iter().copied().collect();
    assert_eq!(marked.len(), marked_set.len(), "a row was marked twice");
    assert_eq!(
        marked_set, produced,
        "every produced row was dispatched (a purge deleted none before)"
    );
    loop {
        let r = store.purge(Duration::ZERO, 1_000).await.unwrap();
        if r.deleted == 0 && !r.locked_out {
            break;
        }
    }
    // Only the never-purgeable rows are left (retention 0 takes the young ones too).
    assert_eq!(b.count("1 = 1").await, 15);
    let left = b.rows_of(&untouchable[10..]).await;
    assert_eq!(left, keep[10..].to_vec(), "purge touched live or dead rows");
}

// ======================================================================================
// 7. Pause, and graceful shutdown
// ======================================================================================

/// While paused, a running relay publishes nothing and producers keep writing; a drain
/// refuses to start, naming the reason; resume delivers everything.
pub(crate) async fn pause_stops_relays_not_producers<B: Backend>() {
    let b = B::create("pause", DEFAULT_MAX).await;
    let store = b.store();
    let p = store.pause_state().await.unwrap();
    assert!(!p.paused && p.reason.is_none(), "{p:?}");

    let (sink, seen) = RecordingSink::new();
    let handle = Relay::new(store.clone(), sink, relay_config("relay-pause")).spawn();
    b.enqueue_all(&messages("t.pause.v1", 5)).await;
    wait_dispatched(&store, 5, Duration::from_secs(10)).await;

    let t0 = b.db_now_us().await;
    store.set_pause(Some("maintenance window")).await.unwrap();
    let t1 = b.db_now_us().await;
    let p = store.pause_state().await.unwrap();
    assert!(p.paused);
    assert_eq!(p.reason.as_deref(), Some("maintenance window"));
    let changed = p.changed_at.unwrap().timestamp_micros();
    assert!(
        changed >= t0 - 1_000 && changed <= t1 + 1_000,
        "changed_at on the database clock: {changed} vs [{t0}, {t1}]"
    );

    // A relay reads the switch at most a second apart; from then on it publishes nothing,
    // while producers keep writing.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let later = b.enqueue_all(&messages("t.pause.v1", 10)).await;
    assert!(later.iter().all(|e| e.inserted));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(total(&seen), 5, "published while paused");
    let c = store.counts().await.unwrap();
    assert_eq!((c.pending, c.claimed, c.dispatched), (10, 0, 5), "{c:?}");

    let mut cfg = relay_config("relay-drain");
    cfg.drain = true;
    let (sink2, seen2) = RecordingSink::new();
    match Relay::new(store.clone(), sink2, cfg).spawn().wait().await {
        Err(RelayError::Paused { reason }) => assert_eq!(reason, "maintenance window"),
        other => panic!("expected Paused, got {other:?}"),
    }
    assert_eq!(total(&seen2), 0);

    store.set_pause(None).await.unwrap();
    let p = store.pause_state().await.unwrap();
    assert!(!p.paused && p.reason.is_none(), "{p:?}");
    wait_dispatched(&store, 15, Duration::from_secs(10)).await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, 15);
    let seen = seen.lock().unwrap().clone();
    for e in &later {
        assert_eq!(seen.get(&e.message_id), Some(&1));
    }
}

/// Reports each batch it is handed, then never answers.
struct BlackHole {
    handed: tokio::sync::mpsc::UnboundedSender<usize>,
}

#[async_trait]
impl Sink for BlackHole {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async {
            let _ = self.handed.send(batch.len());
            std::future::pending().await
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }

    fn describe(&self) -> String {
        "black hole".into()
    }
}

/// Graceful shutdown with a sink that never answers: after the grace period the relay
/// releases its claims (attempt given back, due at once), and another relay delivers them.
pub(crate) async fn shutdown_releases_in_flight_claims<B: Backend>() {
    let b = B::create("shut", DEFAULT_MAX).await;
    let store = b.store();
    let enq = b.enqueue_all(&messages("t.shutdown.v1", 5)).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut cfg = relay_config("relay-shutdown");
    cfg.shutdown_grace = Duration::from_millis(300);
    cfg.publish_timeout = Duration::from_secs(20);
    let handle = Relay::new(store.clone(), Arc::new(BlackHole { handed: tx }), cfg).spawn();
    let n = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the relay never published")
        .unwrap();
    assert_eq!(n, 5);
    for r in b.rows_of(&ids).await {
        assert_eq!((r.status, r.attempts), (status::CLAIMED, 1), "{r:?}");
    }

    let start = Instant::now();
    let stats = tokio::time::timeout(Duration::from_secs(10), handle.shutdown())
        .await
        .expect("shutdown() did not return")
        .unwrap();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(250),
        "shutdown skipped the grace: {took:?}"
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert_eq!((stats.released, stats.dispatched), (5, 0), "{stats:?}");
    let now = b.db_now_us().await;
    for r in b.rows_of(&ids).await {
        assert_eq!((r.status, r.attempts), (status::PENDING, 0), "{r:?}");
        assert_eq!((r.claim_token, r.locked_until), (None, None));
        assert!(r.available_at <= now, "released rows are due at once");
    }

    let (sink, seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-after");
    cfg.drain = true;
    let stats = Relay::new(store.clone(), sink, cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(stats.dispatched, 5);
    let seen = seen.lock().unwrap().clone();
    for e in &enq {
        assert_eq!(seen.get(&e.message_id), Some(&1));
    }
    assert!(b.rows_of(&ids).await.iter().all(|r| r.attempts == 1));
}

// ======================================================================================
// 8. Enqueue: atomic with the business change, idempotent, delayed
// ======================================================================================

/// The business change and its messages commit or roll back together (rollback, and a
/// transaction dropped without commit, leave neither).
pub(crate) async fn enqueue_commits_and_rolls_back_with_the_business_change<B: Backend>() {
    let b = B::create("atom", DEFAULT_MAX).await;
    for (order, end) in [(1, End::Rollback), (2, End::Drop), (3, End::Commit)] {
        let m = Message::new("orders.order-placed.v1", format!("{{\"order\":{order}}}"))
            .key(format!("order-{order}"));
        let r = b
            .produce(
                std::slice::from_ref(&m),
                TxOpts {
                    business_row: Some(order),
                    end,
                    ..TxOpts::default()
                },
            )
            .await;
        let e = r.into_iter().next().unwrap().unwrap();
        assert!(e.inserted);
        let expected = i64::from(end == End::Commit);
        // Dropped transactions roll back on their connection's next use; give it a moment.
        if end == End::Drop {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(b.orders(order).await, expected, "{end:?}: business row");
        let filter = format!("message_id = '{}'", m.id().hyphenated());
        assert_eq!(b.count(&filter).await, expected, "{end:?}: message");
        if end == End::Commit {
            let r = b.row(e.id).await;
            assert_eq!(r.message_id, m.id());
            assert_eq!(r.key.as_deref(), Some("order-3"));
            assert_eq!(r.payload, b"{\"order\":3}");
            assert_eq!(r.status, status::PENDING);
        }
    }
    assert_eq!(
        b.count("1 = 1").await,
        1,
        "only the committed message exists"
    );
}

/// Enqueue is idempotent on the message id: twice in one transaction, across
/// transactions, and from two producers at once (the second waits for the first) → the
/// same row id, `inserted: false`, and the transaction still commits; the store's SQL entry
/// point for other languages is idempotent too. `Message::available_at` and
/// `Message::delay` hold a message back; a past `available_at` is due at once.
pub(crate) async fn enqueue_is_idempotent_and_delays_hold<B: Backend>() {
    let b = Arc::new(B::create("idem", DEFAULT_MAX).await);
    let store = b.store();
    let id = Uuid::now_v7();
    let first = Message::new("t.idem.v1", b"first".to_vec()).message_id(id);
    let second = Message::new("t.idem.v1", b"second".to_vec()).message_id(id);
    let other = Message::new("t.idem.v1", b"other".to_vec());
    let r: Vec<Enqueued> = b
        .produce(
            &[first.clone(), second.clone(), other.clone()],
            TxOpts::default(),
        )
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert!(r[0].inserted && !r[1].inserted && r[2].inserted, "{r:?}");
    assert_eq!(r[0].id, r[1].id);
    assert_eq!(r[1].message_id, id);
    assert_ne!(r[2].id, r[0].id);
    let again = b.enqueue_all(std::slice::from_ref(&second)).await;
    assert_eq!((again[0].id, again[0].inserted), (r[0].id, false));
    let rows = b.select_rows(&format!("message_id = '{id}'")).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].payload, b"first", "the first payload is kept");
    assert_eq!(b.count("1 = 1").await, 2, "the other message committed too");

    // Two producers at once with the same id: the second waits, then gets the row back.
    let race = Message::new("t.idem.v1", b"race".to_vec());
    let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<()>();
    let (b1, m1) = (b.clone(), race.clone());
    let holder = tokio::spawn(async move {
        // Enqueue, then hold the transaction open until told to commit.
        b1.produce_held(&m1, gate_rx).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (b2, m2) = (b.clone(), race.clone());
    let racer = tokio::spawn(async move { b2.enqueue_all(&[m2]).await.pop().unwrap() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !racer.is_finished(),
        "the second producer must wait for the first's uncommitted row"
    );
    gate_tx.send(()).unwrap();
    let e1 = holder.await.unwrap();
    let e2 = racer.await.unwrap();
    assert!(e1.inserted);
    assert_eq!((e2.id, e2.inserted), (e1.id, false));

    // The SQL entry point: twice in one transaction, again in another, then from Rust.
    let sql_id = Uuid::now_v7();
    let call = |payload: &[u8]| SqlCall {
        topic: "t.sql.v1".into(),
        payload: payload.to_vec(),
        key: Some("k1".into()),
        message_id: Some(sql_id),
        headers: serde_json::json!({"tenant": "acme"}),
    };
    let got = b.sql_enqueue(&[call(b"one"), call(b"two")]).await.unwrap();
    assert_eq!(got[0], got[1]);
    let got2 = b.sql_enqueue(&[call(b"three")]).await.unwrap();
    assert_eq!(got2[0], got[0]);
    let from_rust = b
        .enqueue_all(&[Message::new("t.sql.v1", b"four".to_vec()).message_id(sql_id)])
        .await;
    assert_eq!((from_rust[0].id, from_rust[0].inserted), (got[0], false));
    let rows = b.select_rows(&format!("message_id = '{sql_id}'")).await;
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!((r.id, r.status), (got[0], status::PENDING));
    assert_eq!(r.payload, b"one");
    assert_eq!(r.key.as_deref(), Some("k1"));
    assert_eq!(r.headers, serde_json::json!({"tenant": "acme"}));
    // A row from the SQL entry point is due at once and claimable like any other.
    let c = claim(&store, "relay-idem", 100, LONG).await;
    let claimed: HashSet<i64> = claim_ids(&c).into_iter().collect();
    assert!(
        claimed.contains(&got[0]),
        "SQL-enqueued row not claimable: {claimed:?}"
    );
    assert_eq!(claimed.len(), 4);
    let m = c.messages.iter().find(|m| m.id == got[0]).unwrap();
    assert_eq!(m.message_id, sql_id);
    assert_eq!(m.headers.get("tenant").map(String::as_str), Some("acme"));
    store
        .mark_dispatched(c.token, &claim_ids(&c))
        .await
        .unwrap();

    // Without a message id, the SQL entry point makes a fresh UUIDv7 per call.
    if B::KIND != Kind::Sqlite {
        let call = SqlCall {
            topic: "t.sql.v1".into(),
            payload: vec![0],
            key: None,
            message_id: None,
            headers: serde_json::json!({}),
        };
        let got = b.sql_enqueue(&[call.clone(), call]).await.unwrap();
        assert_ne!(got[0], got[1]);
        let rows = b.rows_of(&got).await;
        assert_eq!(rows.len(), 2);
        assert_ne!(rows[0].message_id, rows[1].message_id);
        for r in &rows {
            assert_eq!(r.message_id.get_version_num(), 7, "{}", r.message_id);
            let ms = r.message_id.get_timestamp().unwrap().to_unix();
            let ms = i64::try_from(ms.0).unwrap() * 1000 + i64::from(ms.1 / 1_000_000);
            assert!(
                (ms - Utc::now().timestamp_millis()).abs() < 10_000,
                "the UUIDv7 time is now: {}",
                r.message_id
            );
        }
        let c = claim(&store, "relay-idem", 100, LONG).await;
        assert_eq!(claim_ids(&c), got);
        store.mark_dispatched(c.token, &got).await.unwrap();
    }

    // Delayed availability.
    let hour = chrono::Duration::hours(1);
    let later_at = Utc::now() + hour;
    let past_at = Utc::now() - hour;
    let t0 = b.db_now_us().await;
    let enq = b
        .enqueue_all(&[
            Message::new("t.delay.v1", b"at".to_vec()).available_at(later_at),
            Message::new("t.delay.v1", b"delay".to_vec()).delay(Duration::from_secs(3600)),
            Message::new("t.delay.v1", b"both".to_vec())
                .available_at(past_at)
                .delay(Duration::from_secs(3600)),
        ])
        .await;
    let t1 = b.db_now_us().await;
    let rows = b
        .rows_of(&enq.iter().map(|e| e.id).collect::<Vec<_>>())
        .await;
    assert!(
        (rows[0].available_at - later_at.timestamp_micros()).abs() <= 1_000,
        "{} vs {}",
        rows[0].available_at,
        later_at.timestamp_micros()
    );
    let hour_us = 3_600_000_000;
    assert!(
        rows[1].available_at >= t0 + hour_us - 1_000
            && rows[1].available_at <= t1 + hour_us + 1_000,
        "delay counts from the database clock: {} vs [{t0}, {t1}] + 1 h",
        rows[1].available_at
    );
    assert!(
        (rows[2].available_at - past_at.timestamp_micros()).abs() <= 1_000,
        "available_at wins over delay"
    );
    let c = claim(&store, "relay-idem", 100, LONG).await;
    assert_eq!(
        claim_ids(&c),
        vec![enq[2].id],
        "only the past-dated message is due"
    );
}

// ======================================================================================
// 9. Payload and header fidelity
// ======================================================================================

/// Payload bytes and header text come back from a claim exactly as enqueued: every byte
/// value, invalid UTF-8, NUL bytes, empty, 1 MiB; non-ASCII and empty header values and
/// keys. What a store cannot hold is refused at enqueue, inside the producer's
/// transaction, which still commits its other rows.
pub(crate) async fn payloads_and_headers_survive_byte_for_byte<B: Backend>() {
    const LIMIT: usize = 2 * 1024 * 1024;
    let b = B::create("bytes", LIMIT).await;
    let store = b.store();
    let mut big = vec![0u8; 1024 * 1024];
    rand::fill(&mut big[..]);
    let all_bytes: Vec<u8> = (0..=255u8).collect();
    type Case = (
        Vec<u8>,
        Option<&'static str>,
        Vec<(&'static str, &'static str)>,
    );
    let cases: Vec<Case> = vec![
        (
            all_bytes.clone(),
            Some("ключ-1"),
            vec![("note", "grüße ✓ 日本語 🚀")],
        ),
        (
            vec![0xff, 0xfe, 0xc3, 0x28, 0x80, 0xed, 0xa0, 0x80, 0xf8],
            None,
            vec![("empty", ""), ("nokkel", "värde ✓")],
        ),
        (b"\0\0a\0b\0".to_vec(), Some(""), vec![("tab", "a\tb\r\nc")]),
        (
            Vec::new(),
            None,
            vec![("quote", "\"'\\`"), ("json", "{\"x\":[1]}")],
        ),
        (big.clone(), Some("big"), vec![("control", "\u{1}\u{7f}")]),
        (all_bytes.iter().rev().copied().collect(), None, vec![]),
    ];
    let msgs: Vec<Message> = cases
        .iter()
        .map(|(payload, key, headers)| {
            let mut m = Message::new("t.bytes.v1", payload.clone());
            if let Some(k) = key {
                m = m.key(*k);
            }
            for (k, v) in headers {
                m = m.header(*k, *v);
            }
            m
        })
        .collect();
    let enq = b.enqueue_all(&msgs).await;

    let c = claim(&store, "relay-bytes", 100, LONG).await;
    assert!(c.malformed.is_empty(), "{:?}", c.malformed);
    assert_eq!(claim_ids(&c), enq.iter().map(|e| e.id).collect::<Vec<_>>());
    let rows = b.rows_of(&claim_ids(&c)).await;
    for (((m, (payload, key, headers)), sent), row) in
        c.messages.iter().zip(&cases).zip(&msgs).zip(&rows)
    {
        assert_eq!(m.message_id, sent.id());
        assert_eq!(m.topic, "t.bytes.v1");
        assert!(m.payload[..] == payload[..], "payload of {} changed", m.id);
        assert!(
            row.payload == *payload,
            "stored payload of {} changed",
            m.id
        );
        assert_eq!(m.key.as_deref(), *key);
        let expected: BTreeMap<String, String> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        assert_eq!(m.headers, expected);
    }
    store
        .mark_dispatched(c.token, &claim_ids(&c))
        .await
        .unwrap();

    // Refused inside the transaction; the transaction goes on and commits the rest.
    let too_big =
        Message::new("t.bytes.v1", vec![7u8; LIMIT - 20]).header("tenant", "x".repeat(40));
    let nul_header = Message::new("t.bytes.v1", b"ok".to_vec()).header("h", "a\0b");
    let nul_key = Message::new("t.bytes.v1", b"ok".to_vec()).key("k\0");
    let ok1 = Message::new("t.bytes.v1", b"before".to_vec());
    let ok2 = Message::new("t.bytes.v1", b"after".to_vec());
    let r = b
        .produce(
            &[
                ok1.clone(),
                too_big.clone(),
                nul_header.clone(),
                nul_key.clone(),
                ok2.clone(),
            ],
            TxOpts::default(),
        )
        .await;
    assert!(r[0].is_ok() && r[4].is_ok(), "{r:?}");
    match &r[1] {
        Err(e @ Error::MessageTooLarge { size, limit }) => {
            assert_eq!(*limit, LIMIT);
            assert_eq!(*size, LIMIT - 20 + "t.bytes.v1".len() + "tenant".len() + 40);
            assert!(e.to_string().contains("too large"), "{e}");
        }
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }
    for refused in [&r[2], &r[3]] {
        match refused {
            Err(e @ Error::InvalidMessage(_)) => assert!(e.to_string().contains("NUL"), "{e}"),
            other => panic!("expected InvalidMessage, got {other:?}"),
        }
    }
    for m in [&ok1, &ok2] {
        assert_eq!(b.count(&format!("message_id = '{}'", m.id())).await, 1);
    }
    // Header names are HTTP tokens (what every sink can carry as a header name).
    let bad_name = Message::new("t.bytes.v1", b"ok".to_vec()).header("nøkkel", "v");
    let r = b
        .produce(std::slice::from_ref(&bad_name), TxOpts::default())
        .await;
    match &r[0] {
        Err(e @ Error::InvalidMessage(_)) => assert!(e.to_string().contains("header name"), "{e}"),
        other => panic!("expected InvalidMessage, got {other:?}"),
    }
    assert_eq!(
        b.count(&format!("message_id = '{}'", bad_name.id())).await,
        0
    );
    for m in [&too_big, &nul_header, &nul_key] {
        assert_eq!(b.count(&format!("message_id = '{}'", m.id())).await, 0);
    }

    // The SQL entry point applies the limit too (SQLite's is a plain INSERT: no check).
    if B::KIND != Kind::Sqlite {
        let call = SqlCall {
            topic: "t.bytes.v1".into(),
            payload: vec![0u8; LIMIT + 1],
            key: None,
            message_id: Some(Uuid::now_v7()),
            headers: serde_json::json!({}),
        };
        let err = b.sql_enqueue(&[call]).await.unwrap_err();
        assert!(err.contains("too large"), "{err}");
    }
}

// ======================================================================================
// 10. The claim's plan
// ======================================================================================

/// With many dispatched rows and a few pending ones, the claim reads the live-row index,
/// not the table (latency is for the benchmark; this asserts the plan).
pub(crate) async fn claim_uses_the_live_row_index<B: Backend>() {
    let b = B::create("plan", DEFAULT_MAX).await;
    let store = b.store();
    let n: u64 = match B::KIND {
        Kind::Postgres | Kind::Sqlite => 1_000_000,
        Kind::MySql => 200_000,
    };
    let start = Instant::now();
    b.bulk_insert_dispatched(n, Duration::from_secs(60)).await;
    eprintln!(
        "{:?}: {n} dispatched rows inserted in {:?}",
        B::KIND,
        start.elapsed()
    );
    let live = b.enqueue_all(&messages("t.plan.v1", 5)).await;
    b.analyze().await;
    b.assert_claim_uses_live_index().await;
    let c = claim(&store, "relay-plan", 100, LONG).await;
    assert_eq!(claim_ids(&c), live.iter().map(|e| e.id).collect::<Vec<_>>());
    let counts = store.counts().await.unwrap();
    assert_eq!((counts.dispatched, counts.claimed), (n as i64, 5));
}

// ======================================================================================
// Leases still held
// ======================================================================================

/// `Store::leases` counts claimed rows whose lease has not ended on the database clock and
/// says when the last one ends: pending rows (delayed ones included), expired claims and
/// settled rows are not counted; nothing held is `0, None, None`.
pub(crate) async fn leases_count_live_claims_until_their_last_end<B: Backend>() {
    let b = B::create("leases", DEFAULT_MAX).await;
    let store = b.store();
    let nothing = outbox::store::Leases {
        held: 0,
        last_ends_at: None,
        last_ends_in: None,
    };
    assert_eq!(store.leases().await.unwrap(), nothing, "an empty outbox");
    let mut msgs = messages("t.leases.v1", 5);
    msgs.push(Message::new("t.leases.v1", b"later".to_vec()).delay(Duration::from_secs(3600)));
    b.enqueue_all(&msgs).await;
    assert_eq!(
        store.leases().await.unwrap(),
        nothing,
        "pending rows hold no lease"
    );

    let short = claim(&store, "relay-short", 2, Duration::from_millis(1500)).await;
    let long_lease = Duration::from_secs(60);
    let before = b.db_now_us().await;
    let long = claim(&store, "relay-long", 2, long_lease).await;
    let after = b.db_now_us().await;
    assert_eq!((short.messages.len(), long.messages.len()), (2, 2));

    let l = store.leases().await.unwrap();
    assert_eq!(l.held, 4, "{l:?}");
    let ends_at = l.last_ends_at.expect("a last lease end").timestamp_micros();
    // The long claim's lease end, on the database clock (ms precision on SQLite).
    assert!(
        ends_at >= before + us(long_lease) - 1_000 && ends_at <= after + us(long_lease) + 1_000,
        "last lease end {ends_at} not within the long claim's [{before}, {after}] + 60 s"
    );
    let ends_in = l.last_ends_in.expect("time until the last lease end");
    assert!(
        ends_in > long_lease - Duration::from_secs(5)
            && ends_in <= long_lease + Duration::from_millis(1),
        "{ends_in:?}"
    );

    // Once the short lease has ended, its rows are claimable and no longer held.
    let s = store.clone();
    wait_until("the short lease ends", Duration::from_secs(10), || {
        let s = s.clone();
        async move {
            let l = s.leases().await.unwrap();
            if l.held == 2 {
                Ok(())
            } else {
                Err(format!("{l:?}"))
            }
        }
    })
    .await;
    assert_eq!(
        b.count("status = 1").await,
        4,
        "the expired claim is still status 1"
    );
    let l = store.leases().await.unwrap();
    assert_eq!(l.last_ends_at.map(|t| t.timestamp_micros()), Some(ends_at));

    // Settled rows hold nothing.
    assert_eq!(
        store
            .mark_dispatched(long.token, &claim_ids(&long))
            .await
            .unwrap(),
        2
    );
    assert_eq!(store.leases().await.unwrap(), nothing);
}

// ======================================================================================
// The macro
// ======================================================================================

/// Instantiates every case for one backend type, each as its own test.
macro_rules! conformance_cases {
    ($backend:ty) => {
        $crate::conformance::conformance_cases!(@each $backend;
            row_lifecycle,
            concurrent_claimers_never_overlap,
            expired_lease_fences_the_stale_claimant,
            database_clock_decides_eligibility,
            poison_is_bounded_and_later_rows_flow,
            crash_looping_claims_are_bounded,
            purge_deletes_old_dispatched_rows_in_bounded_batches,
            pause_stops_relays_not_producers,
            shutdown_releases_in_flight_claims,
            enqueue_commits_and_rolls_back_with_the_business_change,
            enqueue_is_idempotent_and_delays_hold,
            payloads_and_headers_survive_byte_for_byte,
            claim_uses_the_live_row_index,
            leases_count_live_claims_until_their_last_end,
            dead_letters_are_listed_replayed_and_audited,
            relay_registry_heartbeats_and_expires,
            topic_pauses_hold_only_matching_topics,
            overview_counts_due_expired_and_topics,
        );
    };
    (@each $backend:ty; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                $crate::conformance::$case::<$backend>().await;
            }
        )*
    };
}
pub(crate) use conformance_cases;
