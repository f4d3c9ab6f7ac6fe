//! The consumer inbox (`outbox::inbox`) against the real databases, one test per store:
//! PostgreSQL (a schema of its own), MariaDB (a table prefix of its own, consumers on an
//! application pool at the server's default `REPEATABLE READ`) and SQLite (a temp file).
//!
//! Each test runs one body of cases ([`suite`]): a race of two consumer transactions per
//! message id, repeated; three consumer transactions on one id whose first rolls back; a duplicate after processing with a follow-up enqueued under
//! `follow_up_id`; a rolled-back consumer; the SQL entry point; the purge by age in
//! batches; and accept + commit latency (printed, not asserted: run with `--no-capture`).

#![allow(clippy::unwrap_used)]

use crate::common::{MySqlPrefix, PgSchema, mysql_connect, mysql_url};
use async_trait::async_trait;
use outbox::inbox::{Accepted, follow_up_id};
use outbox::message::Message;
use outbox::mysql::MySqlStore;
use outbox::sqlite::SqliteStore;
use outbox::store::prelude::*;
use outbox::{Error, Store};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Row as _};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tempfile::TempDir;
use tokio::sync::Barrier;
use uuid::Uuid;

const FOLLOW_UP_TOPIC: &str = "t.invoice-requested.v1";

/// How a consumer transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Commit,
    Rollback,
}

/// What a case needs from one store: a consumer transaction, and ways to look inside.
#[async_trait]
trait Harness: Send + Sync + 'static {
    const NAME: &'static str;

    fn store(&self) -> Arc<dyn Store>;

    /// The store's database.
    type Db: sqlx::Database;
    /// The store, typed: what a consumer accepts and enqueues through.
    type Typed: outbox::inbox::Inbox<Database = Self::Db>
        + outbox::events::Enqueue<Database = Self::Db>;

    fn typed(&self) -> &Self::Typed;

    /// The pool consumer transactions run on.
    fn consumer_pool(&self) -> &sqlx::Pool<Self::Db>;

    /// The business change of a fresh message: one `business` row.
    async fn insert_business(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Db>,
        id: Uuid,
        consumer: &str,
    ) -> outbox::Result<()>;

    /// One consumer transaction, written once for every store (through the library's
    /// `Inbox` and `Enqueue` traits): begin; wait at `gate` (when given, so two
    /// transactions are open at once); accept `id` for `consumer`; when fresh, insert the
    /// business row (and, with `follow_up`, enqueue the follow-up under `follow_up_id`);
    /// end.
    async fn handle(
        &self,
        consumer: &str,
        id: Uuid,
        follow_up: bool,
        gate: Option<Arc<Barrier>>,
        end: End,
    ) -> outbox::Result<Accepted> {
        use outbox::events::Enqueue as _;
        use outbox::inbox::Inbox as _;
        let mut tx = self.consumer_pool().begin().await?;
        let racing = gate.is_some();
        if let Some(g) = gate {
            g.wait().await;
        }
        let a = self.typed().accept_in(&mut tx, consumer, &id).await?;
        hold_if_racing(racing, a).await;
        if a.is_fresh() {
            self.insert_business(&mut tx, id, consumer).await?;
            if follow_up {
                let m = Message::new(FOLLOW_UP_TOPIC, b"{}".to_vec())
                    .message_id(follow_up_id(id, FOLLOW_UP_TOPIC));
                self.typed().enqueue_in(&mut tx, &m).await?;
            }
        }
        match end {
            End::Commit => tx.commit().await?,
            End::Rollback => tx.rollback().await?,
        }
        Ok(a)
    }

    /// PostgreSQL: accept a duplicate, then keep using the transaction (a statement, an
    /// insert) and commit. Other stores: nothing.
    async fn use_after_duplicate(&self, _consumer: &str, _id: Uuid) {}

    /// Business rows: (all, distinct message ids).
    async fn business(&self) -> (i64, i64);

    /// Business rows of `id`.
    async fn business_of(&self, id: Uuid) -> i64;

    /// Inbox rows of `consumer`.
    async fn inbox_rows(&self, consumer: &str) -> i64;

    /// Outbox rows with message id `id`.
    async fn messages_with_id(&self, id: Uuid) -> i64;

    /// Moves the `received_at` of `consumer`'s rows for `ids` back by `by`.
    async fn age(&self, consumer: &str, ids: &[Uuid], by: Duration);

    /// The SQL entry point for other languages: `Ok(true)` when fresh.
    async fn sql_accept(&self, consumer: &str, id: Uuid) -> Result<bool, String>;

    /// An invalid consumer name refused before SQL, with the transaction still usable.
    async fn refuses_bad_consumer(&self, consumer: &str) -> bool;

    /// The SQL entry point inside the consumer's transaction `tx`: `Ok(true)` when fresh.
    async fn sql_accept_in(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Db>,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, String>;

    /// Returns once `n` transactions wait for a row lock on the inbox (PostgreSQL and
    /// MariaDB read the server's lock waits; SQLite has one writer, whose waiters show
    /// nowhere: a pause lets them reach the busy handler, and the case's outcome is the
    /// same in any order).
    async fn wait_for_inbox_waiters(&self, n: i64);
}

// ---------------------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------------------

async fn suite<H: Harness>(h: Arc<H>) {
    race(&h).await;
    three_consumers_after_a_rollback(&h).await;
    duplicate_after_processing(&h).await;
    rolled_back_consumer(&h).await;
    h.use_after_duplicate("after-dup", Uuid::now_v7()).await;
    sql_entry_point(&h).await;
    bad_consumer(&h).await;
    purge_by_age(&h).await;
    latency(&h).await;
}

/// Race attempts per store (`OUTBOX_TEST_INBOX_RACES` overrides it).
fn races() -> usize {
    std::env::var("OUTBOX_TEST_INBOX_RACES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000)
}

/// The same message id accepted by two concurrent consumer transactions, each inserting
/// a business row when fresh, `races()` times: exactly one business row per id, the other
/// outcome a duplicate, no error.
async fn race<H: Harness>(h: &Arc<H>) {
    let n = races();
    let (mut fresh, mut duplicate, mut errors) = (0usize, 0usize, Vec::new());
    // Duplicates whose transaction took at least the fresh one's hold: they met the
    // uncommitted row on the unique key and waited for its commit.
    let mut waited = 0usize;
    let start = Instant::now();
    for _ in 0..n {
        let id = Uuid::now_v7();
        let gate = Arc::new(Barrier::new(2));
        let tasks: Vec<_> = (0..2)
            .map(|_| {
                let h = h.clone();
                let gate = gate.clone();
                tokio::spawn(async move {
                    let t = Instant::now();
                    let a = h.handle("race", id, false, Some(gate), End::Commit).await;
                    (a, t.elapsed())
                })
            })
            .collect();
        let mut fresh_here = 0;
        for t in tasks {
            let (a, took) = t.await.unwrap();
            match a {
                Ok(Accepted::Fresh) => {
                    fresh += 1;
                    fresh_here += 1;
                }
                Ok(Accepted::Duplicate) => {
                    duplicate += 1;
                    waited += usize::from(took >= HOLD);
                }
                Err(e) => errors.push(format!("{id}: {e}")),
            }
        }
        assert!(fresh_here <= 1, "{id} was fresh twice");
    }
    let took = start.elapsed();
    println!(
        "{} inbox race: {n} ids x 2 concurrent consumers = {} attempts: {fresh} fresh, \
         {duplicate} duplicate ({waited} of them took >= {HOLD:?}, waiting on the other's \
         uncommitted row), {} errors ({took:.1?})",
        H::NAME,
        2 * n,
        errors.len()
    );
    assert!(errors.is_empty(), "errors surfaced: {errors:?}");
    assert_eq!(fresh, n);
    assert_eq!(duplicate, n);
    let (rows, distinct) = h.business().await;
    assert_eq!(
        (rows, distinct),
        (n as i64, n as i64),
        "one business row per id"
    );
    assert_eq!(h.inbox_rows("race").await, n as i64);
}

/// Three consumer transactions on one message id: the first accepts it (fresh) and holds
/// its uncommitted row while the two others wait on it, then rolls back. Of the two
/// waiters exactly one is fresh and the other a duplicate, neither gets an error (on
/// InnoDB, two waiters each holding a shared lock on the key and both wanting it
/// exclusive would be a deadlock), and one business row remains. Repeated, through the
/// library's accept and through the SQL entry point.
async fn three_consumers_after_a_rollback<H: Harness>(h: &Arc<H>) {
    for via_sql in [false, true] {
        let mut errors = Vec::new();
        for round in 0..30 {
            let id = Uuid::now_v7();
            let consumer = format!("three-{via_sql}");
            let mut first = h.consumer_pool().begin().await.unwrap();
            let fresh = if via_sql {
                h.sql_accept_in(&mut first, &consumer, id).await.unwrap()
            } else {
                use outbox::inbox::Inbox as _;
                h.typed()
                    .accept_in(&mut first, &consumer, &id)
                    .await
                    .unwrap()
                    .is_fresh()
            };
            assert!(fresh, "the first accept of {id} is fresh");
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let h = h.clone();
                    let consumer = consumer.clone();
                    tokio::spawn(async move {
                        let mut tx = h.consumer_pool().begin().await.map_err(|e| e.to_string())?;
                        let fresh = if via_sql {
                            h.sql_accept_in(&mut tx, &consumer, id).await?
                        } else {
                            use outbox::inbox::Inbox as _;
                            h.typed()
                                .accept_in(&mut tx, &consumer, &id)
                                .await
                                .map_err(|e| e.to_string())?
                                .is_fresh()
                        };
                        if fresh {
                            h.insert_business(&mut tx, id, &consumer)
                                .await
                                .map_err(|e| e.to_string())?;
                        }
                        tx.commit().await.map_err(|e| e.to_string())?;
                        Ok::<bool, String>(fresh)
                    })
                })
                .collect();
            h.wait_for_inbox_waiters(2).await;
            first.rollback().await.unwrap();
            let mut outcomes = Vec::new();
            for w in waiters {
                match w.await.unwrap() {
                    Ok(fresh) => outcomes.push(fresh),
                    Err(e) => errors.push(format!("round {round}, {id}: {e}")),
                }
            }
            if outcomes.len() == 2 {
                outcomes.sort_unstable();
                assert_eq!(
                    outcomes,
                    vec![false, true],
                    "{id}: one fresh, one duplicate"
                );
                assert_eq!(h.business_of(id).await, 1, "{id}: one business row");
            }
        }
        assert!(
            errors.is_empty(),
            "{} ({}): {} of 30 rolled-back ids raised an error: {errors:?}",
            H::NAME,
            if via_sql {
                "SQL entry point"
            } else {
                "accept_in"
            },
            errors.len()
        );
    }
}

/// A duplicate arriving after processing does nothing; the follow-up enqueued under
/// `follow_up_id` in the consumer's transaction exists once, also when another consumer
/// handling the same message enqueues it again, and not at all after a rollback.
async fn duplicate_after_processing<H: Harness>(h: &Arc<H>) {
    let id = Uuid::now_v7();
    let follow = follow_up_id(id, FOLLOW_UP_TOPIC);

    // A first attempt that rolls back leaves neither the inbox row nor the follow-up.
    let a = h.handle("billing", id, true, None, End::Rollback).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    assert_eq!(h.messages_with_id(follow).await, 0);

    let a = h.handle("billing", id, true, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    for _ in 0..3 {
        let a = h.handle("billing", id, true, None, End::Commit).await;
        assert_eq!(a.unwrap(), Accepted::Duplicate);
    }
    assert_eq!(h.business_of(id).await, 1);
    assert_eq!(h.messages_with_id(follow).await, 1);

    // Another consumer is its own inbox: fresh, its business row, and the same follow-up
    // id again, which enqueue keeps once.
    let a = h.handle("shipping", id, true, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    assert_eq!(h.business_of(id).await, 2);
    assert_eq!(h.messages_with_id(follow).await, 1);
}

/// A rolled-back consumer transaction leaves no inbox row: the message is fresh again.
async fn rolled_back_consumer<H: Harness>(h: &Arc<H>) {
    let id = Uuid::now_v7();
    let rows = h.inbox_rows("rollback").await;
    for _ in 0..3 {
        let a = h.handle("rollback", id, false, None, End::Rollback).await;
        assert_eq!(a.unwrap(), Accepted::Fresh);
        assert_eq!(h.inbox_rows("rollback").await, rows);
        assert_eq!(h.business_of(id).await, 0);
    }
    let a = h.handle("rollback", id, false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    assert_eq!(h.business_of(id).await, 1);
    assert_eq!(h.inbox_rows("rollback").await, rows + 1);
}

/// The SQL entry point agrees with the Rust one, on the same rows.
async fn sql_entry_point<H: Harness>(h: &Arc<H>) {
    let id = Uuid::now_v7();
    assert_eq!(h.sql_accept("sql", id).await, Ok(true));
    assert_eq!(h.sql_accept("sql", id).await, Ok(false));
    let a = h.handle("sql", id, false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Duplicate);
    let other = Uuid::now_v7();
    let a = h.handle("sql", other, false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    assert_eq!(h.sql_accept("sql", other).await, Ok(false));
    assert_eq!(h.sql_accept("sql-other", other).await, Ok(true));
}

async fn bad_consumer<H: Harness>(h: &Arc<H>) {
    let long = "x".repeat(256);
    for bad in ["", "a\nb", "nul\u{0}", long.as_str()] {
        assert!(h.refuses_bad_consumer(bad).await, "{bad:?} was not refused");
    }
}

/// The purge deletes only rows older than the age, oldest first, a batch per call.
async fn purge_by_age<H: Harness>(h: &Arc<H>) {
    let store = h.store();
    // Everything earlier in the suite is seconds old: a first purge at 1 h deletes none.
    assert_eq!(
        store
            .inbox_purge(Duration::from_secs(3600), 1000)
            .await
            .unwrap(),
        0
    );
    let ids: Vec<Uuid> = (0..10).map(|_| Uuid::now_v7()).collect();
    for id in &ids {
        let a = h.handle("purge", *id, false, None, End::Commit).await;
        assert_eq!(a.unwrap(), Accepted::Fresh);
    }
    let (old, young) = ids.split_at(7);
    h.age("purge", old, Duration::from_secs(2 * 3600)).await;
    let before_all = h.inbox_rows("race").await;
    let hour = Duration::from_secs(3600);
    let mut batches = Vec::new();
    loop {
        let n = store.inbox_purge(hour, 3).await.unwrap();
        batches.push(n);
        if n < 3 {
            break;
        }
    }
    assert_eq!(batches, vec![3, 3, 1], "batches of at most 3");
    assert_eq!(h.inbox_rows("purge").await, 3, "the young rows stay");
    assert_eq!(
        h.inbox_rows("race").await,
        before_all,
        "young rows of others stay"
    );
    assert_eq!(store.inbox_purge(hour, 0).await.unwrap(), 0);
    // A purged id is fresh again; a young one is still a duplicate.
    let a = h.handle("purge", old[0], false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    let a = h.handle("purge", young[0], false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Duplicate);
}

/// Accept + commit latency over 1,000 fresh accepts, each in its own transaction
/// (begin, accept, commit; no business row). Printed, not asserted.
async fn latency<H: Harness>(h: &Arc<H>) {
    let mut fresh = Vec::with_capacity(1000);
    let mut dup = Vec::with_capacity(1000);
    let ids: Vec<Uuid> = (0..1000).map(|_| Uuid::now_v7()).collect();
    for (times, want) in [
        (&mut fresh, Accepted::Fresh),
        (&mut dup, Accepted::Duplicate),
    ] {
        for id in &ids {
            let t = Instant::now();
            let a = h.handle("latency", *id, false, None, End::Commit).await;
            times.push(t.elapsed());
            assert_eq!(a.unwrap(), want);
        }
    }
    let pct = |v: &mut Vec<Duration>, p: f64| {
        v.sort();
        v[((v.len() as f64 * p).ceil() as usize).saturating_sub(1)]
    };
    println!(
        "{} inbox accept + commit (business row when fresh), 1,000 each: fresh p50 {:.2?} \
         p99 {:.2?}; duplicate p50 {:.2?} p99 {:.2?}",
        H::NAME,
        pct(&mut fresh, 0.50),
        pct(&mut fresh, 0.99),
        pct(&mut dup, 0.50),
        pct(&mut dup, 0.99),
    );
}

/// In a race, the fresh transaction holds its uncommitted row a moment, so the other
/// accept (released by the same barrier) meets it on the unique key and waits.
async fn hold_if_racing(racing: bool, a: Accepted) {
    if racing && a.is_fresh() {
        tokio::time::sleep(HOLD).await;
    }
}

/// How long the fresh transaction of a race holds its row before it commits.
const HOLD: Duration = Duration::from_millis(2);

// ---------------------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------------------

struct Pg {
    store: outbox::postgres::PgStore,
    schema: PgSchema,
}

impl Pg {
    fn s(&self) -> &str {
        &self.schema.name
    }
}

#[async_trait]
impl Harness for Pg {
    const NAME: &'static str = "PostgreSQL";

    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    type Db = sqlx::Postgres;
    type Typed = outbox::postgres::PgStore;

    fn typed(&self) -> &Self::Typed {
        &self.store
    }

    fn consumer_pool(&self) -> &sqlx::Pool<Self::Db> {
        self.store.pool()
    }

    async fn insert_business(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Db>,
        id: Uuid,
        consumer: &str,
    ) -> outbox::Result<()> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.business (message_id, consumer) VALUES ($1, $2)",
            self.s()
        )))
        .bind(id)
        .bind(consumer)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn use_after_duplicate(&self, consumer: &str, id: Uuid) {
        let a = self.handle(consumer, id, false, None, End::Commit).await;
        assert_eq!(a.unwrap(), Accepted::Fresh);
        let mut tx = self.store.pool().begin().await.unwrap();
        let a = self
            .store
            .inbox_accept(&mut tx, consumer, id)
            .await
            .unwrap();
        assert_eq!(a, Accepted::Duplicate);
        // The transaction is not aborted: another statement runs and the commit keeps it.
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(one, 1);
        let marker = Uuid::now_v7();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.business (message_id, consumer) VALUES ($1, 'after-duplicate')",
            self.s()
        )))
        .bind(marker)
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(self.business_of(marker).await, 1);
    }

    async fn business(&self) -> (i64, i64) {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT message_id) FROM {}.business WHERE consumer = 'race'",
            self.s()
        )))
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }

    async fn business_of(&self, id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.business WHERE message_id = $1",
            self.s()
        )))
        .bind(id)
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }

    async fn inbox_rows(&self, consumer: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.inbox WHERE consumer = $1",
            self.s()
        )))
        .bind(consumer)
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }

    async fn messages_with_id(&self, id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.messages WHERE message_id = $1",
            self.s()
        )))
        .bind(id)
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }

    async fn age(&self, consumer: &str, ids: &[Uuid], by: Duration) {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {}.inbox SET received_at = received_at - $3 * interval '1 second'
             WHERE consumer = $1 AND message_id = ANY($2)",
            self.s()
        )))
        .bind(consumer)
        .bind(ids)
        .bind(by.as_secs_f64())
        .execute(self.store.pool())
        .await
        .unwrap();
    }

    async fn sql_accept(&self, consumer: &str, id: Uuid) -> Result<bool, String> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT {}.inbox_accept($1, $2)",
            self.s()
        )))
        .bind(consumer)
        .bind(id)
        .fetch_one(self.store.pool())
        .await
        .map_err(|e| e.to_string())
    }

    async fn sql_accept_in(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Db>,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, String> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT {}.inbox_accept($1, $2)",
            self.s()
        )))
        .bind(consumer)
        .bind(id)
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| e.to_string())
    }

    async fn wait_for_inbox_waiters(&self, n: i64) {
        let like = format!("%{}.inbox%", self.s());
        for _ in 0..2_000 {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE $1",
            )
            .bind(&like)
            .fetch_one(self.store.pool())
            .await
            .unwrap();
            if waiting >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("{n} inbox lock waiters never showed");
    }

    async fn refuses_bad_consumer(&self, consumer: &str) -> bool {
        let mut tx = self.store.pool().begin().await.unwrap();
        let r = self
            .store
            .inbox_accept(&mut tx, consumer, Uuid::now_v7())
            .await;
        let usable = sqlx::query("SELECT 1").execute(&mut *tx).await.is_ok();
        tx.rollback().await.unwrap();
        // The SQL function refuses the same names.
        let in_sql = self.sql_accept(consumer, Uuid::now_v7()).await;
        matches!(r, Err(Error::InvalidMessage(_)))
            && usable
            // (PostgreSQL text cannot hold NUL at all: the driver's error is the refusal.)
            && in_sql.is_err_and(|e| e.contains("consumer must be") || consumer.contains('\0'))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_inbox() {
    let (store, schema) = crate::common::pg_store("inbox").await;
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {}.business (message_id uuid NOT NULL, consumer text NOT NULL)",
        schema.name
    )))
    .execute(store.pool())
    .await
    .unwrap();
    suite(Arc::new(Pg { store, schema })).await;
}

// ---------------------------------------------------------------------------------------
// MySQL / MariaDB
// ---------------------------------------------------------------------------------------

struct My {
    store: MySqlStore,
    /// The application's pool: server-default isolation (REPEATABLE READ).
    app: MySqlPool,
    prefix: MySqlPrefix,
}

impl My {
    fn p(&self) -> &str {
        &self.prefix.name
    }
}

#[async_trait]
impl Harness for My {
    const NAME: &'static str = "MariaDB";

    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    type Db = sqlx::MySql;
    type Typed = MySqlStore;

    fn typed(&self) -> &Self::Typed {
        &self.store
    }

    /// The application's pool, at the server's default `REPEATABLE READ`.
    fn consumer_pool(&self) -> &sqlx::Pool<Self::Db> {
        &self.app
    }

    async fn insert_business(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Db>,
        id: Uuid,
        consumer: &str,
    ) -> outbox::Result<()> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}_business (message_id, consumer) VALUES (?, ?)",
            self.p()
        )))
        .bind(id.hyphenated().to_string())
        .bind(consumer)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn business(&self) -> (i64, i64) {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT CAST(COUNT(*) AS SIGNED), CAST(COUNT(DISTINCT message_id) AS SIGNED)
             FROM {}_business WHERE consumer = 'race'",
            self.p()
        )))
        .fetch_one(&self.app)
        .await
        .unwrap()
    }

    async fn business_of(&self, id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM {}_business WHERE message_id = ?",
            self.p()
        )))
        .bind(id.hyphenated().to_string())
        .fetch_one(&self.app)
        .await
        .unwrap()
    }

    async fn inbox_rows(&self, consumer: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM {}_inbox WHERE consumer = ?",
            self.p()
        )))
        .bind(consumer.as_bytes())
        .fetch_one(&self.app)
        .await
        .unwrap()
    }

    async fn messages_with_id(&self, id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT CAST(COUNT(*) AS SIGNED) FROM {}_messages WHERE message_id = ?",
            self.p()
        )))
        .bind(id.hyphenated().to_string())
        .fetch_one(&self.app)
        .await
        .unwrap()
    }

    async fn age(&self, consumer: &str, ids: &[Uuid], by: Duration) {
        for id in ids {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {}_inbox SET received_at = TIMESTAMPADD(SECOND, -?, received_at)
                 WHERE consumer = ? AND message_id = ?",
                self.p()
            )))
            .bind(i64::try_from(by.as_secs()).unwrap())
            .bind(consumer.as_bytes())
            .bind(id.hyphenated().to_string())
            .execute(&self.app)
            .await
            .unwrap();
        }
    }

    async fn sql_accept(&self, consumer: &str, id: Uuid) -> Result<bool, String> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "CALL {}_inbox_accept(?, ?)",
            self.p()
        )))
        .bind(consumer)
        .bind(id.hyphenated().to_string())
        .fetch_one(&self.app)
        .await
        .map_err(|e| e.to_string())?;
        let fresh: i64 = row.try_get("fresh").map_err(|e| e.to_string())?;
        Ok(fresh == 1)
    }

    async fn sql_accept_in(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Db>,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, String> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "CALL {}_inbox_accept(?, ?)",
            self.p()
        )))
        .bind(consumer)
        .bind(id.hyphenated().to_string())
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| e.to_string())?;
        let fresh: i64 = row.try_get("fresh").map_err(|e| e.to_string())?;
        Ok(fresh == 1)
    }

    async fn wait_for_inbox_waiters(&self, n: i64) {
        // Sessions inside an accept of this prefix (the first transaction is idle):
        // waiting on the row (InnoDB) or on the id's inbox lock (a user lock).
        let like = format!("%{}%", self.p());
        for _ in 0..2_000 {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.PROCESSLIST
                 WHERE COMMAND <> 'Sleep' AND STATE IN ('Update', 'User lock')
                   AND INFO LIKE ?",
            )
            .bind(&like)
            .fetch_one(&self.app)
            .await
            .unwrap();
            if waiting >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let seen: Vec<(String, String)> = sqlx::query_as(
            "SELECT CAST(COALESCE(STATE, '') AS CHAR), CAST(COALESCE(INFO, '') AS CHAR)
             FROM information_schema.PROCESSLIST WHERE COMMAND <> 'Sleep'",
        )
        .fetch_all(&self.app)
        .await
        .unwrap();
        panic!("{n} inbox lock waiters never showed: {seen:?}");
    }

    async fn refuses_bad_consumer(&self, consumer: &str) -> bool {
        let mut tx = self.app.begin().await.unwrap();
        let r = self
            .store
            .inbox_accept(&mut tx, consumer, Uuid::now_v7())
            .await;
        let usable = sqlx::query("SELECT 1").execute(&mut *tx).await.is_ok();
        tx.rollback().await.unwrap();
        let in_sql = self.sql_accept(consumer, Uuid::now_v7()).await;
        matches!(r, Err(Error::InvalidMessage(_)))
            && usable
            && in_sql.is_err_and(|e| e.contains("consumer must be"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_inbox() {
    drop(mysql_connect().await); // the loud failure when MariaDB is down
    let prefix = MySqlPrefix::new("inbox");
    let config = outbox::StoreConfig {
        schema: prefix.ident(),
        ..outbox::StoreConfig::default()
    };
    let store = MySqlStore::connect(&mysql_url(), config).await.unwrap();
    store.migrate().await.unwrap();
    let app = MySqlPoolOptions::new()
        .max_connections(8)
        .connect(&mysql_url())
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {}_business (message_id CHAR(36) NOT NULL, consumer TEXT NOT NULL,
                                   KEY (message_id)) ENGINE = InnoDB",
        prefix.name
    )))
    .execute(&app)
    .await
    .unwrap();
    // The SQL entry point also refuses what is not a UUID.
    let h = Arc::new(My { store, app, prefix });
    let r = sqlx::query(AssertSqlSafe(format!(
        "CALL {}_inbox_accept('c', 'not-a-uuid')",
        h.p()
    )))
    .fetch_all(&h.app)
    .await;
    assert!(r.is_err_and(|e| e.to_string().contains("must be a UUID")));
    suite(h).await;
}

// ---------------------------------------------------------------------------------------
// SQLite
// ---------------------------------------------------------------------------------------

struct Lite {
    store: SqliteStore,
    _dir: TempDir,
}

#[async_trait]
impl Harness for Lite {
    const NAME: &'static str = "SQLite";

    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    type Db = sqlx::Sqlite;
    type Typed = SqliteStore;

    fn typed(&self) -> &Self::Typed {
        &self.store
    }

    /// Deferred transactions whose first statement is the accept (a write): the second of
    /// two concurrent ones waits for the write lock under the busy timeout.
    fn consumer_pool(&self) -> &sqlx::Pool<Self::Db> {
        self.store.pool()
    }

    async fn insert_business(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Db>,
        id: Uuid,
        consumer: &str,
    ) -> outbox::Result<()> {
        sqlx::query("INSERT INTO business (message_id, consumer) VALUES (?1, ?2)")
            .bind(id.hyphenated().to_string())
            .bind(consumer)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn business(&self) -> (i64, i64) {
        sqlx::query_as(
            "SELECT count(*), count(DISTINCT message_id) FROM business WHERE consumer = 'race'",
        )
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }

    async fn business_of(&self, id: Uuid) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM business WHERE message_id = ?1")
            .bind(id.hyphenated().to_string())
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }

    async fn inbox_rows(&self, consumer: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox_inbox WHERE consumer = ?1")
            .bind(consumer)
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }

    async fn messages_with_id(&self, id: Uuid) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE message_id = ?1")
            .bind(id.hyphenated().to_string())
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }

    async fn age(&self, consumer: &str, ids: &[Uuid], by: Duration) {
        for id in ids {
            sqlx::query(
                "UPDATE outbox_inbox SET received_at = received_at - ?3
                 WHERE consumer = ?1 AND message_id = ?2",
            )
            .bind(consumer)
            .bind(id.hyphenated().to_string())
            .bind(i64::try_from(by.as_millis()).unwrap())
            .execute(self.store.pool())
            .await
            .unwrap();
        }
    }

    /// The documented plain statement and `changes()`, in one transaction.
    async fn sql_accept(&self, consumer: &str, id: Uuid) -> Result<bool, String> {
        let mut tx = self.store.pool().begin().await.map_err(|e| e.to_string())?;
        sqlx::query(
            "INSERT INTO outbox_inbox (consumer, message_id) VALUES (?1, ?2)
             ON CONFLICT DO NOTHING",
        )
        .bind(consumer)
        .bind(id.hyphenated().to_string())
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
        let changes: i64 = sqlx::query_scalar("SELECT changes()")
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        Ok(changes == 1)
    }

    /// The documented plain statement and `changes()`, in the consumer's transaction.
    async fn sql_accept_in(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Db>,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, String> {
        sqlx::query(
            "INSERT INTO outbox_inbox (consumer, message_id) VALUES (?1, ?2)
             ON CONFLICT DO NOTHING",
        )
        .bind(consumer)
        .bind(id.hyphenated().to_string())
        .execute(&mut **tx)
        .await
        .map_err(|e| e.to_string())?;
        let changes: i64 = sqlx::query_scalar("SELECT changes()")
            .fetch_one(&mut **tx)
            .await
            .map_err(|e| e.to_string())?;
        Ok(changes == 1)
    }

    async fn wait_for_inbox_waiters(&self, _n: i64) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    async fn refuses_bad_consumer(&self, consumer: &str) -> bool {
        let mut tx = self.store.pool().begin().await.unwrap();
        let r = self
            .store
            .inbox_accept(&mut tx, consumer, Uuid::now_v7())
            .await;
        let usable = sqlx::query("SELECT 1").execute(&mut *tx).await.is_ok();
        tx.rollback().await.unwrap();
        matches!(r, Err(Error::InvalidMessage(_))) && usable
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_inbox() {
    let (store, dir) = crate::common::sqlite_store().await;
    sqlx::query("CREATE TABLE business (message_id TEXT NOT NULL, consumer TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    suite(Arc::new(Lite { store, _dir: dir })).await;
}
