//! The connection hooks at work: the busy handler's schedule and its wait for another
//! writer, the WAL hook's wake-ups and its checkpoints.

#![allow(clippy::unwrap_used)]

use super::busy::{BUSY_TIMEOUT, busy_sleep};
use super::wakeup::AUTOCHECKPOINT_PAGES;
use super::*;
use crate::message::Message;
use crate::store::Maintenance;
use std::time::Duration;

#[test]
fn the_busy_handler_retries_every_millisecond_then_every_ten_for_five_seconds() {
    let steps: Vec<Duration> = (0..).map_while(busy_sleep).collect();
    assert!(steps[..100].iter().all(|s| *s == Duration::from_millis(1)));
    assert!(steps[100..].iter().all(|s| *s == Duration::from_millis(10)));
    assert_eq!(steps.iter().sum::<Duration>(), BUSY_TIMEOUT);
}

async fn store(dir: &tempfile::TempDir) -> SqliteStore {
    let url = format!("sqlite://{}", dir.path().join("hooks.db").display());
    let store = SqliteStore::connect(&url, StoreConfig::default())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    store
}

async fn enqueue(store: &SqliteStore, payload_bytes: usize, commit: bool) {
    let mut tx = store.pool().begin().await.unwrap();
    let msg = Message::new("t.hooks.v1", vec![b'x'; payload_bytes]);
    store.enqueue(&mut tx, &msg).await.unwrap();
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
}

/// The counter moves by the WAL hook when the commit has ended, with no file watch
/// running (`wakeups()` would start one): a committed insert moves it, a rolled-back
/// one and writes to another table do not.
#[tokio::test]
async fn a_commit_that_inserted_a_message_moves_the_counter_and_a_rollback_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let mut rx = store.inner.wakeup.subscribe();
    rx.mark_unchanged();
    enqueue(&store, 10, false).await;
    assert!(!rx.has_changed().unwrap(), "a rollback moved the counter");
    for sql in [
        "CREATE TABLE business (x INTEGER)",
        "INSERT INTO business VALUES (1)",
    ] {
        sqlx::query(sql).execute(store.pool()).await.unwrap();
    }
    assert!(
        !rx.has_changed().unwrap(),
        "a business write moved the counter"
    );
    enqueue(&store, 10, true).await;
    assert!(
        rx.has_changed().unwrap(),
        "a commit did not move the counter"
    );
}

/// Another writer's lock is waited out under [`busy_step`](super::busy::busy_step), not
/// SQLite's own handler: `PRAGMA busy_timeout` reads 0 on the store's connections
/// (installing a busy handler clears it), yet an enqueue waits for a lock held 300 ms and
/// then commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_connections_wait_for_another_writer_under_their_own_busy_handler() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let timeout_ms: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(timeout_ms, 0, "SQLite's own busy handler is installed");
    let mut other = sqlx::SqliteConnection::connect_with(&store.inner.options)
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .unwrap();
    let writer = store.clone();
    let write = tokio::spawn(async move { enqueue(&writer, 10, true).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !write.is_finished(),
        "the enqueue did not wait for the lock"
    );
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    write.await.unwrap();
}

/// The WAL hook replaces SQLite's auto-checkpoint, so it checkpoints itself: after
/// ~3,000 pages written in 30 commits, the WAL holds about one threshold of frames, not
/// all of them.
#[tokio::test]
async fn the_wal_is_still_checkpointed_every_thousand_pages() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    for _ in 0..30 {
        let mut tx = store.pool().begin().await.unwrap();
        for _ in 0..25 {
            let msg = Message::new("t.hooks.v1", vec![b'x'; 16 * 1024]);
            store.enqueue(&mut tx, &msg).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    // (busy, frames in the WAL, frames checkpointed); PASSIVE changes nothing here
    // when the hook kept up.
    let (_, frames, _): (i64, i64, i64) = sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(
        frames < i64::from(AUTOCHECKPOINT_PAGES) + 200,
        "{frames} frames in the WAL: no checkpoint ran"
    );
}
