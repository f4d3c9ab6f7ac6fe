//! The consumer inbox (`outbox::inbox`) against the real databases, one test per store,
//! each on the store conformance suite's [`Backend`] (`store/conformance_<store>.rs`):
//! PostgreSQL (a schema of its own), MariaDB (a table prefix of its own, consumers on the
//! application's pool at the server's default `REPEATABLE READ`) and SQLite (a temp file,
//! consumers on the store's pool). A consumer's business change is a row of the backend's
//! `business (message_id, consumer)` table.
//!
//! Each test runs one body of cases ([`suite`]): a race of two consumer transactions per
//! message id, repeated; three consumer transactions on one id whose first rolls back; a
//! duplicate after processing with a follow-up enqueued under `follow_up_id`; a rolled-back
//! consumer; a duplicate's transaction used on; the SQL entry point; refused consumer
//! names; the purge by age in batches; and accept + commit latency (printed, not asserted:
//! run with `--no-capture`).

#![allow(clippy::unwrap_used)]

use crate::store::conformance::{Backend, DEFAULT_MAX};
use crate::store::conformance_mysql::MySqlBackend;
use crate::store::conformance_postgres::PgBackend;
use crate::store::conformance_sqlite::SqliteBackend;
use outbox::Error;
use outbox::inbox::{Accepted, follow_up_id};
use outbox::message::Message;
use sqlx::AssertSqlSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Barrier;
use uuid::Uuid;

const FOLLOW_UP_TOPIC: &str = "t.invoice-requested.v1";

/// How a consumer transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Commit,
    Rollback,
}

/// One consumer transaction, written once for every store (through the library's `Inbox`
/// and `Enqueue` traits): begin; wait at `gate` (when given, so two transactions are open
/// at once); accept `id` for `consumer`; when fresh, insert the business row (and, with
/// `follow_up`, enqueue the follow-up under `follow_up_id`); end.
async fn handle<B: Backend>(
    b: &B,
    consumer: &str,
    id: Uuid,
    follow_up: bool,
    gate: Option<Arc<Barrier>>,
    end: End,
) -> outbox::Result<Accepted> {
    use outbox::events::Enqueue as _;
    use outbox::inbox::Inbox as _;
    let mut tx = b.consumer_pool().begin().await?;
    let racing = gate.is_some();
    if let Some(g) = gate {
        g.wait().await;
    }
    let a = b.enqueuer().accept_in(&mut tx, consumer, &id).await?;
    hold_if_racing(racing, a).await;
    if a.is_fresh() {
        insert_business(b, &mut tx, id, consumer).await?;
        if follow_up {
            let m = Message::new(FOLLOW_UP_TOPIC, b"{}".to_vec())
                .message_id(follow_up_id(id, FOLLOW_UP_TOPIC));
            b.enqueuer().enqueue_in(&mut tx, &m).await?;
        }
    }
    match end {
        End::Commit => tx.commit().await?,
        End::Rollback => tx.rollback().await?,
    }
    Ok(a)
}

/// The business change of a fresh message: one `business` row.
async fn insert_business<B: Backend>(
    b: &B,
    tx: &mut sqlx::Transaction<'_, B::Database>,
    id: Uuid,
    consumer: &str,
) -> Result<u64, sqlx::Error> {
    let table = b.table("business");
    b.execute_in(
        tx,
        &format!("INSERT INTO {table} (message_id, consumer) VALUES ('{id}', '{consumer}')"),
    )
    .await
}

/// Business rows of `id`.
async fn business_of<B: Backend>(b: &B, id: Uuid) -> i64 {
    let table = b.table("business");
    b.scalar(&format!(
        "SELECT count(*) FROM {table} WHERE message_id = '{id}'"
    ))
    .await
}

/// Inbox rows of `consumer`.
async fn inbox_rows<B: Backend>(b: &B, consumer: &str) -> i64 {
    let table = b.table("inbox");
    b.scalar(&format!(
        "SELECT count(*) FROM {table} WHERE consumer = '{consumer}'"
    ))
    .await
}

/// Outbox rows with message id `id`.
async fn messages_with_id<B: Backend>(b: &B, id: Uuid) -> i64 {
    b.count(&format!("message_id = '{id}'")).await
}

/// Moves the `received_at` of `consumer`'s rows for `ids` back by `by`.
async fn age<B: Backend>(b: &B, consumer: &str, ids: &[Uuid], by: Duration) {
    let table = b.table("inbox");
    let ids: Vec<String> = ids.iter().map(|id| format!("'{id}'")).collect();
    let mut tx = b.app().begin().await.unwrap();
    let aged = b
        .execute_in(
            &mut tx,
            &format!(
                "UPDATE {table} SET received_at = {} WHERE consumer = '{consumer}' AND message_id IN ({})",
                b.before("received_at", by),
                ids.join(", ")
            ),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(aged, ids.len() as u64);
}

// ---------------------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------------------

async fn suite<B: Backend>(h: Arc<B>) {
    race(&h).await;
    three_consumers_after_a_rollback(&h).await;
    duplicate_after_processing(&h).await;
    rolled_back_consumer(&h).await;
    use_after_duplicate(&h).await;
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
async fn race<B: Backend>(h: &Arc<B>) {
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
                    let a = handle(&*h, "race", id, false, Some(gate), End::Commit).await;
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
        "{:?} inbox race: {n} ids x 2 concurrent consumers = {} attempts: {fresh} fresh, \
         {duplicate} duplicate ({waited} of them took >= {HOLD:?}, waiting on the other's \
         uncommitted row), {} errors ({took:.1?})",
        B::KIND,
        2 * n,
        errors.len()
    );
    assert!(errors.is_empty(), "errors surfaced: {errors:?}");
    assert_eq!(fresh, n);
    assert_eq!(duplicate, n);
    let (rows, distinct) = (
        h.scalar(&format!(
            "SELECT count(*) FROM {} WHERE consumer = 'race'",
            h.table("business")
        ))
        .await,
        h.scalar(&format!(
            "SELECT count(DISTINCT message_id) FROM {} WHERE consumer = 'race'",
            h.table("business")
        ))
        .await,
    );
    assert_eq!(
        (rows, distinct),
        (n as i64, n as i64),
        "one business row per id"
    );
    assert_eq!(inbox_rows(&**h, "race").await, n as i64);
}

/// Three consumer transactions on one message id: the first accepts it (fresh) and holds
/// its uncommitted row while the two others wait on it, then rolls back. Of the two
/// waiters exactly one is fresh and the other a duplicate, neither gets an error (on
/// InnoDB, two waiters each holding a shared lock on the key and both wanting it
/// exclusive would be a deadlock), and one business row remains. Repeated, through the
/// library's accept and through the SQL entry point.
async fn three_consumers_after_a_rollback<B: Backend>(h: &Arc<B>) {
    for via_sql in [false, true] {
        let mut errors = Vec::new();
        for round in 0..30 {
            let id = Uuid::now_v7();
            let consumer = format!("three-{via_sql}");
            let mut first = h.consumer_pool().begin().await.unwrap();
            let fresh = if via_sql {
                h.sql_inbox_accept_in(&mut first, &consumer, id)
                    .await
                    .unwrap()
            } else {
                use outbox::inbox::Inbox as _;
                h.enqueuer()
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
                            h.sql_inbox_accept_in(&mut tx, &consumer, id).await?
                        } else {
                            use outbox::inbox::Inbox as _;
                            h.enqueuer()
                                .accept_in(&mut tx, &consumer, &id)
                                .await
                                .map_err(|e| e.to_string())?
                                .is_fresh()
                        };
                        if fresh {
                            insert_business(&*h, &mut tx, id, &consumer)
                                .await
                                .map_err(|e| e.to_string())?;
                        }
                        tx.commit().await.map_err(|e| e.to_string())?;
                        Ok::<bool, String>(fresh)
                    })
                })
                .collect();
            // Both waiters at the first's uncommitted row (on SQLite: time to reach the write
            // lock; the outcome is the same in any order).
            h.wait_for_lock_waiters(2, Duration::from_millis(20)).await;
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
                assert_eq!(business_of(&**h, id).await, 1, "{id}: one business row");
            }
        }
        assert!(
            errors.is_empty(),
            "{:?} ({}): {} of 30 rolled-back ids raised an error: {errors:?}",
            B::KIND,
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
async fn duplicate_after_processing<B: Backend>(h: &Arc<B>) {
    let id = Uuid::now_v7();
    let follow = follow_up_id(id, FOLLOW_UP_TOPIC);

    // A first attempt that rolls back leaves neither the inbox row nor the follow-up.
    let a = handle(&**h, "billing", id, true, None, End::Rollback).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    assert_eq!(messages_with_id(&**h, follow).await, 0);

    let a = handle(&**h, "billing", id, true, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    for _ in 0..3 {
        let a = handle(&**h, "billing", id, true, None, End::Commit).await;
        assert_eq!(a.unwrap(), Accepted::Duplicate);
    }
    assert_eq!(business_of(&**h, id).await, 1);
    assert_eq!(messages_with_id(&**h, follow).await, 1);

    // Another consumer is its own inbox: fresh, its business row, and the same follow-up
    // id again, which enqueue keeps once.
    let a = handle(&**h, "shipping", id, true, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    assert_eq!(business_of(&**h, id).await, 2);
    assert_eq!(messages_with_id(&**h, follow).await, 1);
}

/// A rolled-back consumer transaction leaves no inbox row: the message is fresh again.
async fn rolled_back_consumer<B: Backend>(h: &Arc<B>) {
    let id = Uuid::now_v7();
    let rows = inbox_rows(&**h, "rollback").await;
    for _ in 0..3 {
        let a = handle(&**h, "rollback", id, false, None, End::Rollback).await;
        assert_eq!(a.unwrap(), Accepted::Fresh);
        assert_eq!(inbox_rows(&**h, "rollback").await, rows);
        assert_eq!(business_of(&**h, id).await, 0);
    }
    let a = handle(&**h, "rollback", id, false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    assert_eq!(business_of(&**h, id).await, 1);
    assert_eq!(inbox_rows(&**h, "rollback").await, rows + 1);
}

/// The SQL entry point agrees with the Rust one, on the same rows.
async fn sql_entry_point<B: Backend>(h: &Arc<B>) {
    let id = Uuid::now_v7();
    assert_eq!(h.sql_inbox_accept("sql", id).await, Ok(true));
    assert_eq!(h.sql_inbox_accept("sql", id).await, Ok(false));
    let a = handle(&**h, "sql", id, false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Duplicate);
    let other = Uuid::now_v7();
    let a = handle(&**h, "sql", other, false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    assert_eq!(h.sql_inbox_accept("sql", other).await, Ok(false));
    assert_eq!(h.sql_inbox_accept("sql-other", other).await, Ok(true));
}

/// A consumer name that is empty, over 255 bytes or holds a control character is refused
/// before any SQL runs, the transaction still usable; the SQL entry point refuses the same
/// names where it checks them (a NUL, which PostgreSQL's text cannot hold, is refused by
/// the driver there).
async fn bad_consumer<B: Backend>(h: &Arc<B>) {
    use outbox::inbox::Inbox as _;
    let long = "x".repeat(256);
    for bad in ["", "a\nb", "nul\u{0}", long.as_str()] {
        let mut tx = h.consumer_pool().begin().await.unwrap();
        let r = h.enqueuer().accept_in(&mut tx, bad, &Uuid::now_v7()).await;
        assert!(
            matches!(r, Err(Error::InvalidMessage(_))),
            "{bad:?} was not refused: {r:?}"
        );
        let usable = h.execute_in(&mut tx, "SELECT 1").await;
        assert!(
            usable.is_ok(),
            "{bad:?}: the transaction is unusable: {usable:?}"
        );
        tx.rollback().await.unwrap();
        if B::SQL_ENTRY_CHECKS {
            let in_sql = h.sql_inbox_accept(bad, Uuid::now_v7()).await;
            assert!(
                in_sql
                    .as_ref()
                    .is_err_and(|e| e.contains("consumer must be")
                        || (bad.contains('\0') && !B::TEXT_HOLDS_NUL)),
                "{bad:?} in SQL: {in_sql:?}"
            );
        }
    }
}

/// The purge deletes only rows older than the age, oldest first, a batch per call.
async fn purge_by_age<B: Backend>(h: &Arc<B>) {
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
        let a = handle(&**h, "purge", *id, false, None, End::Commit).await;
        assert_eq!(a.unwrap(), Accepted::Fresh);
    }
    let (old, young) = ids.split_at(7);
    age(&**h, "purge", old, Duration::from_secs(2 * 3600)).await;
    let before_all = inbox_rows(&**h, "race").await;
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
    assert_eq!(inbox_rows(&**h, "purge").await, 3, "the young rows stay");
    assert_eq!(
        inbox_rows(&**h, "race").await,
        before_all,
        "young rows of others stay"
    );
    assert_eq!(store.inbox_purge(hour, 0).await.unwrap(), 0);
    // A purged id is fresh again; a young one is still a duplicate.
    let a = handle(&**h, "purge", old[0], false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    let a = handle(&**h, "purge", young[0], false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Duplicate);
}

/// Accept + commit latency over 1,000 fresh accepts, each in its own transaction
/// (begin, accept, commit; no business row). Printed, not asserted.
async fn latency<B: Backend>(h: &Arc<B>) {
    let mut fresh = Vec::with_capacity(1000);
    let mut dup = Vec::with_capacity(1000);
    let ids: Vec<Uuid> = (0..1000).map(|_| Uuid::now_v7()).collect();
    for (times, want) in [
        (&mut fresh, Accepted::Fresh),
        (&mut dup, Accepted::Duplicate),
    ] {
        for id in &ids {
            let t = Instant::now();
            let a = handle(&**h, "latency", *id, false, None, End::Commit).await;
            times.push(t.elapsed());
            assert_eq!(a.unwrap(), want);
        }
    }
    let pct = |v: &mut Vec<Duration>, p: f64| {
        v.sort();
        v[((v.len() as f64 * p).ceil() as usize).saturating_sub(1)]
    };
    println!(
        "{:?} inbox accept + commit (business row when fresh), 1,000 each: fresh p50 {:.2?} \
         p99 {:.2?}; duplicate p50 {:.2?} p99 {:.2?}",
        B::KIND,
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

/// A duplicate's transaction is not aborted (on PostgreSQL a unique violation would abort
/// it): after the accept another statement runs, an insert too, and the commit keeps them.
async fn use_after_duplicate<B: Backend>(h: &Arc<B>) {
    use outbox::inbox::Inbox as _;
    let id = Uuid::now_v7();
    let a = handle(&**h, "after-dup", id, false, None, End::Commit).await;
    assert_eq!(a.unwrap(), Accepted::Fresh);
    let mut tx = h.consumer_pool().begin().await.unwrap();
    let a = h.enqueuer().accept_in(&mut tx, "after-dup", &id).await;
    assert_eq!(a.unwrap(), Accepted::Duplicate);
    h.execute_in(&mut tx, "SELECT 1").await.unwrap();
    let marker = Uuid::now_v7();
    insert_business(&**h, &mut tx, marker, "after-duplicate")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(business_of(&**h, marker).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_inbox() {
    suite(Arc::new(PgBackend::create("inbox", DEFAULT_MAX).await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_inbox() {
    let b = Arc::new(MySqlBackend::create("inbox", DEFAULT_MAX).await);
    // The SQL entry point also refuses what is not a UUID.
    let r = sqlx::query(AssertSqlSafe(format!(
        "CALL {}_inbox_accept('c', 'not-a-uuid')",
        b.p()
    )))
    .fetch_all(b.app())
    .await;
    assert!(r.is_err_and(|e| e.to_string().contains("must be a UUID")));
    suite(b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_inbox() {
    suite(Arc::new(SqliteBackend::create("inbox", DEFAULT_MAX).await)).await;
}
