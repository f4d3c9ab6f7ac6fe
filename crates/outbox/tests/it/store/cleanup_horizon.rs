//! What holds back the database's cleanup (`Views::cleanup_horizon`): an open transaction
//! of another session, held for the test's duration, is reported at least as old as it is
//! on PostgreSQL (REPEATABLE READ with a snapshot taken) and MariaDB (`START TRANSACTION
//! WITH CONSISTENT SNAPSHOT`); SQLite tells nothing. Other tests share the servers and may
//! hold transactions of their own: ages are asserted as lower bounds.

use crate::common::{MySqlPrefix, mysql_connect, mysql_url, pg_connect, pg_store, sqlite_store};
use outbox::StoreConfig;
use outbox::mysql::MySqlStore;
use outbox::store::prelude::*;
use std::time::{Duration, Instant};

/// How old the test's open transaction must be reported.
const HELD: Duration = Duration::from_secs(2);

/// Waits until `store` reports an open transaction at least `age` old, which must happen
/// within `late` of the test's transaction reaching that age (started just before this
/// call): the age is not under-reported by more. Returns that report.
async fn reported_at_least<S: Views>(
    store: &S,
    age: Duration,
    late: Duration,
) -> outbox::store::CleanupHorizon {
    let report = tokio::sync::Mutex::new(None);
    crate::common::wait_until(
        &format!("an open transaction reported at least {age:?} old"),
        age + late,
        || async {
            let h = store.cleanup_horizon().await.unwrap();
            let old = h
                .oldest
                .as_ref()
                .is_some_and(|o| o.age_s >= age.as_secs_f64());
            let state = format!("{h:?}");
            if old {
                *report.lock().await = Some(h);
                Ok(())
            } else {
                Err(state)
            }
        },
    )
    .await;
    report.into_inner().unwrap()
}

#[tokio::test]
async fn postgres_reports_a_held_snapshot() {
    let (store, _schema) = pg_store("horizon").await;
    let mut held = pg_connect().await;
    sqlx::query("SET application_name = 'outbox_test_held_snapshot'")
        .execute(&mut held)
        .await
        .unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut held)
        .await
        .unwrap();
    // The first statement takes the snapshot (backend_xmin is set from here on).
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut held)
        .await
        .unwrap();
    let began = Instant::now();
    let h = reported_at_least(&store, HELD, HELD / 4).await;
    let oldest = h.oldest.as_ref().expect("an open transaction is reported");
    let held_s = began.elapsed().as_secs_f64();
    assert!(
        oldest.age_s >= HELD.as_secs_f64(),
        "held {held_s:.1} s, reported {h:?}"
    );
    assert!(h.xmin_age.is_some(), "{h:?}");
    if oldest.pid == Some(i64::from(pid)) {
        assert_eq!(
            oldest.application.as_deref(),
            Some("outbox_test_held_snapshot")
        );
        assert_eq!(oldest.state.as_deref(), Some("idle in transaction"));
        assert_eq!(oldest.kind, "session");
    }
    sqlx::query("ROLLBACK").execute(&mut held).await.unwrap();
}

#[tokio::test]
async fn mariadb_reports_a_held_consistent_snapshot() {
    let prefix = MySqlPrefix::new("horizon");
    let config = StoreConfig {
        schema: prefix.ident(),
        max_message_bytes: outbox::store::DEFAULT_MAX_MESSAGE_BYTES,
    };
    let store = MySqlStore::connect(&mysql_url(), config).await.unwrap();
    store.migrate().await.unwrap();
    let mut held = mysql_connect().await;
    sqlx::query("START TRANSACTION WITH CONSISTENT SNAPSHOT")
        .execute(&mut held)
        .await
        .unwrap();
    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut held)
        .await
        .unwrap();
    // trx_started has whole seconds: the age may show up to one second late.
    let h = reported_at_least(&store, HELD, HELD / 4 + Duration::from_secs(1)).await;
    let oldest = h.oldest.as_ref().expect("an open transaction is reported");
    assert!(oldest.age_s >= HELD.as_secs_f64(), "{h:?}");
    if oldest.pid == Some(id as i64) {
        assert_eq!(oldest.user.as_deref(), Some("root"));
    }
    assert_eq!(h.xmin_age, None);
    sqlx::query("ROLLBACK").execute(&mut held).await.unwrap();
}

#[tokio::test]
async fn sqlite_tells_nothing() {
    let (store, _dir) = sqlite_store().await;
    assert_eq!(
        store.cleanup_horizon().await.unwrap(),
        outbox::store::CleanupHorizon::default()
    );
}
