//! The store conformance suite: one body of cases, instantiated once per store by
//! [`conformance_cases!`] in `store/conformance_postgres.rs`, `store/conformance_mysql.rs`
//! and `store/conformance_sqlite.rs`, so every case is its own `#[tokio::test]` per store.
//!
//! A case talks to the store through [`outbox::Store`] (what a relay uses) and to the
//! database through a [`Backend`]: the producer's side (enqueue is typed per store, inside a
//! transaction the case commits, rolls back or drops), raw SQL to look at rows, and the few
//! store-specific things a case needs (the SQL entry point for other languages, a bulk
//! insert, the claim's query plan, a lock held from outside, the sessions waiting on one).
//! The backends are each store's one harness: the relay, sink and consumer rooms borrow
//! them (the inbox cases of `consumer/inbox.rs`: a consumer's transaction, the inbox's SQL
//! entry point, the business table `business`).
//!
//! Each case asserts what the store contract promises (the guarantees and the row lifecycle
//! of ARCHITECTURE.md); where stores legitimately differ (SQLite has one writer, so a purge is never
//! locked out), the case asserts each behaviour by a capability constant of the [`Backend`]
//! (`SINGLE_WRITER`, `SQL_ENTRY_CHECKS`, …), never by naming a store.

// Each test binary instantiates one backend: the other stores' variants are unused there.

mod lifecycle;
pub(crate) use lifecycle::*;
mod concurrency;
pub(crate) use concurrency::*;
mod leases;
pub(crate) use leases::*;
mod clock;
pub(crate) use clock::*;
mod purge;
pub(crate) use purge::*;
mod pause;
pub(crate) use pause::*;
mod enqueue;
pub(crate) use enqueue::*;
mod fidelity;
pub(crate) use fidelity::*;
mod plans;
pub(crate) use plans::*;
mod operations;
pub(crate) use operations::*;
mod relay_instances;
pub(crate) use relay_instances::*;
mod schema;
pub(crate) use schema::*;
mod wakeups;
pub(crate) use wakeups::*;
mod ordering;
pub(crate) use ordering::*;
mod lookup;
pub(crate) use lookup::*;
mod jobs;
pub(crate) use jobs::*;

use crate::common::{RecordingSink, messages, relay_config, wait_until};
use async_trait::async_trait;
use chrono::Utc;
use outbox::message::{Enqueued, Message};
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

/// The producer's transaction after its business row, for every store alike: each
/// message enqueued through the store's [`outbox::events::Enqueue`], then the ending.
pub(crate) async fn enqueue_and_end<S: outbox::events::Enqueue>(
    store: &S,
    mut tx: sqlx::Transaction<'_, S::Database>,
    msgs: &[Message],
    end: End,
) -> Result<Vec<outbox::Result<Enqueued>>, String> {
    let mut out = Vec::with_capacity(msgs.len());
    for m in msgs {
        out.push(store.enqueue_in(&mut tx, m).await);
    }
    match end {
        End::Commit => tx.commit().await.map_err(|e| e.to_string())?,
        End::Rollback => tx.rollback().await.map_err(|e| e.to_string())?,
        End::Drop => drop(tx),
    }
    Ok(out)
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

/// What a case needs from one store. Each implementation owns an isolated store (its own
/// PostgreSQL schema, MariaDB table prefix or SQLite file), migrated, with the business
/// tables `orders (id, note)` (producers) and `business (message_id, consumer)`
/// (consumers, `consumer/inbox.rs`) beside it, and cleans it up when dropped.
#[async_trait]
pub(crate) trait Backend: Send + Sync + Sized + 'static {
    /// For messages only: cases decide by the capabilities below, never by the store.
    const KIND: Kind;
    /// The schema version this build's store migrates to.
    const SCHEMA_VERSION: i64;
    /// One writer at a time (SQLite): a second purge waits for the write lock instead of
    /// being locked out by the purge lock.
    const SINGLE_WRITER: bool;
    /// The SQL entry point checks what `enqueue` checks (size, a fresh id per call);
    /// SQLite's is a plain `INSERT` with no checks of its own.
    const SQL_ENTRY_CHECKS: bool;
    /// Dispatched rows the plan case inserts (MySQL's bulk insert is slower per row).
    const PLAN_ROWS: u64;
    /// The database clock's now, as SQL of the store's time columns.
    const NOW: &'static str;
    /// Text holds a NUL character (PostgreSQL's cannot: the driver refuses such a value
    /// before the SQL entry point can).
    const TEXT_HOLDS_NUL: bool;
    /// The database whose transactions the backend hands out (a held write lock).
    type Database: sqlx::Database;
    /// The typed store producers enqueue and consumers accept through.
    type Enqueuer: outbox::events::Enqueue<Database = Self::Database>
        + outbox::inbox::Inbox<Database = Self::Database>;

    /// A fresh migrated store whose `StoreConfig.max_message_bytes` is `max_message_bytes`.
    async fn create(label: &str, max_message_bytes: usize) -> Self;

    /// A store in the same database under a schema (PostgreSQL) or table prefix nobody
    /// migrated, and that name.
    async fn unmigrated(&self) -> (Arc<dyn Store>, String);

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

    /// The store's table `name` as SQL names it (`messages`, `inbox`, the business tables
    /// `orders` and `business`): schema-qualified or prefixed.
    fn table(&self, name: &str) -> String;

    /// SQL of the time `time` (SQL of a time column's type) less `by`.
    fn before(&self, time: &str, by: Duration) -> String;

    /// The one integer `sql` selects, on the application's pool.
    async fn scalar(&self, sql: &str) -> i64;

    /// Runs `sql` inside `tx`; the rows it changed.
    async fn execute_in(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Database>,
        sql: &str,
    ) -> Result<u64, sqlx::Error>;

    /// The database clock, microseconds since the Unix epoch (UTC).
    async fn db_now_us(&self) -> i64;

    /// Inserts `n` dispatched rows (dispatched `ago` before now) in bulk, with SQL.
    async fn bulk_insert_dispatched(&self, n: u64, ago: Duration);

    /// Refreshes the planner's statistics of the messages table.
    async fn analyze(&self);

    /// Asserts that the claim's query plan reads the live-row index, not the table; the
    /// query is checked against the store's source so the two stay in sync.
    async fn assert_claim_uses_live_index(&self);

    /// Holds, from another connection, a lock that makes a purge of rows dispatched over an
    /// hour ago wait.
    async fn hold_write_lock(&self) -> sqlx::Transaction<'static, Self::Database>;

    /// Calls the store's SQL entry point once per call, all in one transaction, and
    /// returns each call's row id; `Err` (the transaction rolled back) on a database error.
    async fn sql_enqueue(&self, calls: &[SqlCall]) -> Result<Vec<i64>, String>;

    /// Enqueues `msg` in a transaction that stays open (holding the new row), says so on
    /// `enqueued`, and commits when `gate` fires.
    async fn produce_held(
        &self,
        msg: &Message,
        enqueued: tokio::sync::oneshot::Sender<()>,
        gate: tokio::sync::oneshot::Receiver<()>,
    ) -> Enqueued {
        let mut tx = self.app().begin().await.unwrap();
        let e = outbox::events::Enqueue::enqueue_in(self.enqueuer(), &mut tx, msg)
            .await
            .unwrap();
        enqueued.send(()).unwrap();
        gate.await.unwrap();
        tx.commit().await.unwrap();
        e
    }

    /// The store's SQL entry point for consumers in other languages, inside `tx`:
    /// `Ok(true)` when `id` is fresh for `consumer`.
    async fn sql_inbox_accept_in(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Database>,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, String>;

    /// Sessions of this store waiting for a lock another transaction holds, as the server
    /// shows them (PostgreSQL `pg_stat_activity`, MariaDB's process list and InnoDB lock
    /// waits); `None` where nothing shows them (SQLite: a statement waiting for the one
    /// writer's lock retries in its busy handler, unseen).
    async fn lock_waiters(&self) -> Option<i64>;

    /// The store, typed: what a producer enqueues through.
    fn enqueuer(&self) -> &Self::Enqueuer;

    /// The application's own pool (producers, inspection).
    fn app(&self) -> &sqlx::Pool<Self::Database>;

    // -------------------------------------------------------------------- provided

    /// The pool consumer transactions run on: the application's.
    fn consumer_pool(&self) -> &sqlx::Pool<Self::Database> {
        self.app()
    }

    /// The messages table as the cases read it: each row with the status the library
    /// names (0 pending, 1 claimed, 2 dispatched, 3 dead) in `status`. A store that stores
    /// a claim otherwise (PostgreSQL and SQLite keep `status` 0 and mark a claim by its
    /// token) derives it here ([`status_by_token`]); by default the table itself.
    fn messages(&self) -> String {
        self.table("messages")
    }

    /// Rows of the messages table matching `filter` (on [`Backend::messages`]).
    async fn count(&self, filter: &str) -> i64 {
        self.scalar(&format!(
            "SELECT count(*) FROM {} WHERE {filter}",
            self.messages()
        ))
        .await
    }

    /// Business rows with this id.
    async fn orders(&self, id: i64) -> i64 {
        self.scalar(&format!(
            "SELECT count(*) FROM {} WHERE id = {id}",
            self.table("orders")
        ))
        .await
    }

    /// Sets `dispatched_at` and `occurred_at` of rows `ids` (whatever their status) to
    /// `ago` before the database clock's now.
    async fn set_dispatched_at_ago(&self, ids: &[i64], ago: Duration) {
        let t = self.before(Self::NOW, ago);
        let mut tx = self.app().begin().await.unwrap();
        let sql = format!(
            "UPDATE {} SET dispatched_at = {t}, occurred_at = {t} WHERE {}",
            self.table("messages"),
            id_filter(ids)
        );
        self.execute_in(&mut tx, &sql).await.unwrap();
        tx.commit().await.unwrap();
    }

    /// The SQL entry point for consumers, in a transaction of its own.
    async fn sql_inbox_accept(&self, consumer: &str, id: Uuid) -> Result<bool, String> {
        let mut tx = self
            .consumer_pool()
            .begin()
            .await
            .map_err(|e| e.to_string())?;
        let fresh = self.sql_inbox_accept_in(&mut tx, consumer, id).await?;
        tx.commit().await.map_err(|e| e.to_string())?;
        Ok(fresh)
    }

    /// Returns once `n` sessions wait for a lock held by another ([`Backend::lock_waiters`]);
    /// where waiters cannot be seen, after `unseen`, the time they get to reach the lock.
    async fn wait_for_lock_waiters(&self, n: i64, unseen: Duration) {
        if self.lock_waiters().await.is_none() {
            tokio::time::sleep(unseen).await;
            return;
        }
        wait_until(
            &format!("{n} sessions waiting for a lock"),
            Duration::from_secs(10),
            || async move {
                match self.lock_waiters().await {
                    Some(w) if w >= n => Ok(()),
                    w => Err(format!("{w:?} waiting")),
                }
            },
        )
        .await;
    }

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

    /// Every row, by id.
    async fn rows(&self) -> Vec<Row> {
        self.select_rows("1 = 1").await
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

/// `table` (the messages table) as a subquery whose `status` is the library's, derived
/// from the stored status and the claim token (a live row holding a token is claimed), of
/// SQL type `status_type`.
pub(crate) fn status_by_token(table: &str, status_type: &str) -> String {
    format!(
        "(SELECT id, message_id, topic, key, payload, headers, occurred_at, available_at,
                 CAST(CASE WHEN status <= 1 THEN CASE WHEN claim_token IS NULL THEN 0 ELSE 1 END
                           ELSE status END AS {status_type}) AS status,
                 attempts, claimed_by, claim_token, locked_until, dispatched_at, last_error,
                 replay_id
          FROM {table}) AS messages"
    )
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

pub(crate) async fn claim(
    store: &Arc<dyn Store>,
    relay: &str,
    batch: u32,
    lease: Duration,
) -> Claim {
    store
        .claim(&ClaimRequest {
            relay_id: relay.to_owned(),
            batch_size: batch,
            lease,
            skip_topics: Vec::new(),
            ordering: Default::default(),
        })
        .await
        .unwrap()
}

/// The ordered claim the plan cases explain: 100 rows, topics `t.>` ordered, strict.
pub(crate) fn ordered_plan_request() -> ClaimRequest {
    ClaimRequest {
        relay_id: "plan".into(),
        batch_size: 100,
        lease: Duration::from_secs(30),
        skip_topics: Vec::new(),
        ordering: outbox::store::KeyOrdering {
            topics: vec![outbox::sink::router::TopicPattern::parse("t.>").unwrap()],
            skip_dead: false,
        },
    }
}

/// A claimer racing producers: claims `batch` rows as `relay` and marks each claim
/// dispatched (all its rows must be marked), handing every claim to `each` first, until a
/// claim finds nothing once `producing` is false (read before the claim: then every
/// committed row was claimed by someone). After a claim that found nothing it waits, as an
/// idle relay does, for the store's next wake-up (a commit), at most 100 ms.
pub(crate) async fn claim_until_drained(
    store: &Arc<dyn Store>,
    relay: &str,
    batch: u32,
    producing: &AtomicBool,
    mut each: impl FnMut(&Claim) + Send,
) {
    use outbox::store::prelude::*;
    let mut wakeups = store.wakeups();
    loop {
        let done = !producing.load(Ordering::SeqCst);
        let c = store
            .claim(&ClaimRequest {
                relay_id: relay.to_owned(),
                batch_size: batch,
                lease: LONG,
                skip_topics: Vec::new(),
                ordering: Default::default(),
            })
            .await
            .unwrap_or_else(|e| panic!("{relay}: claim failed: {e}"));
        if c.messages.is_empty() {
            if done {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), wakeups.changed()).await;
            continue;
        }
        each(&c);
        let ids = claim_ids(&c);
        let n = store
            .mark_dispatched(c.token, &ids)
            .await
            .unwrap_or_else(|e| panic!("{relay}: mark failed: {e}"));
        assert_eq!(n, ids.len() as u64, "{relay} lost rows of its claim");
    }
}

pub(crate) fn claim_ids(c: &Claim) -> Vec<i64> {
    c.messages.iter().map(|m| m.id).collect()
}

pub(crate) const LONG: Duration = Duration::from_secs(60);

/// Waits until the database clock has moved at least a millisecond past its reading now,
/// so the next write is stamped strictly later than everything written before this call.
pub(crate) async fn clock_moves_on<B: Backend>(b: &B) {
    let t = b.db_now_us().await;
    wait_until(
        "the database clock to move on",
        Duration::from_secs(5),
        || async move {
            let now = b.db_now_us().await;
            if now >= t + 1_000 {
                Ok(())
            } else {
                Err(format!("{now} us, not past {t} us"))
            }
        },
    )
    .await;
}

// ======================================================================================
// The macro
// ======================================================================================

/// Instantiates every case for one backend type, each as its own test.
macro_rules! conformance_cases {
    ($backend:ty) => {
        $crate::store::conformance::conformance_cases!(@each $backend;
            row_lifecycle,
            concurrent_claimers_never_overlap,
            expired_lease_fences_the_stale_claimant,
            database_clock_decides_eligibility,
            purge_deletes_old_dispatched_rows_in_bounded_batches,
            pause_switch_is_kept_on_the_database_clock,
            enqueue_commits_and_rolls_back_with_the_business_change,
            enqueue_is_idempotent_and_delays_hold,
            payloads_and_headers_survive_byte_for_byte,
            claim_uses_the_live_row_index,
            leases_count_live_claims_until_their_last_end,
            dead_letters_are_listed_replayed_and_audited,
            relay_registry_heartbeats_and_expires,
            relay_instances_are_kept_apart,
            a_second_relay_in_one_program_under_its_id_is_refused,
            topic_pauses_hold_only_matching_topics,
            topic_pause_patterns_hold_the_same_topics_on_every_store,
            overview_counts_due_expired_and_topics,
            a_deleting_settle_removes_only_confirmed_rows,
            an_unmigrated_store_is_named_not_guessed,
            a_commit_moves_the_wakeup_counter,
            ordered_claims_follow_each_key,
            concurrent_ordered_claims_keep_each_key_in_order,
            parked_rows_wait_behind_dead_letters_until_released,
            messages_are_found_where_they_are_and_minutes_counted,
            job_handlers_settle_each_outcome,
            a_job_past_its_timeout_counts_like_a_publish_timeout,
            job_handlers_keep_their_concurrency_limit,
            shutdown_waits_for_running_jobs_and_gives_back_the_rest,
            jobs_behind_the_concurrency_limit_cost_no_attempts,
            a_relay_killed_mid_job_leaves_it_to_run_again_after_the_lease,
        );
    };
    (@each $backend:ty; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                $crate::store::conformance::$case::<$backend>().await;
            }
        )*
    };
}
pub(crate) use conformance_cases;
