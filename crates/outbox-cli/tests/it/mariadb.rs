//! The `outbox` binary against MariaDB (127.0.0.1:3306, root, database `test`) and NATS
//! JetStream: other-language producers through `CALL outbox_enqueue(...)`, and producers
//! racing three relays without a deadlock or lock-wait error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{MYSQL, NATS, outbox, run_ok, unique, wait_for};
use outbox::mysql::MySqlStore;
use outbox::{Ident, Message, StoreConfig};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const START_MARIADB: &str =
    "start it with: start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd";

fn mariadb(sql: &str) -> String {
    let mut child = Command::new("mariadb")
        .args(["-h", "127.0.0.1", "-u", "root", "-N", "-B", "test"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("the mariadb client must be installed ({e}); {START_MARIADB}"));
    let _ = child.stdin.take().unwrap().write_all(sql.as_bytes());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "mariadb failed (is MariaDB running? {START_MARIADB}): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn status(prefix: &str) -> serde_json::Value {
    let out = run_ok(outbox().args([
        "--database-url",
        MYSQL,
        "--schema",
        prefix,
        "status",
        "--json",
    ]));
    serde_json::from_str(out.trim()).unwrap()
}

fn drop_tables(prefix: &str) {
    mariadb(&format!(
        "DROP PROCEDURE IF EXISTS {prefix}_enqueue; DROP PROCEDURE IF EXISTS {prefix}_inbox_accept; DROP TABLE IF EXISTS {prefix}_messages, {prefix}_control, {prefix}_schema_migrations, {prefix}_replays, {prefix}_relays, {prefix}_topic_pauses, {prefix}_inbox, {prefix}_orders;"
    ));
}

/// 2,000 transactions each inserting a business row and calling `CALL outbox_enqueue(...)`
/// from the mariadb client, 100 more rolled back; `outbox relay --drain` to JetStream
/// delivers exactly the 2,000 committed message ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_outbox_enqueue_to_jetstream_exactly_the_committed_ids() {
    let prefix = unique("macc");
    run_ok(outbox().args(["--database-url", MYSQL, "--schema", &prefix, "migrate"]));
    mariadb(&format!(
        "CREATE TABLE {prefix}_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, total BIGINT NOT NULL);"
    ));
    let js = crate::common::jetstream().await;
    let subjects = format!("{prefix}.orders");
    let stream_name = prefix.to_uppercase();
    let mut stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream_name.clone(),
            subjects: vec![format!("{subjects}.>")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();

    let mut sql = String::new();
    let mut committed = HashSet::new();
    for i in 0..2_100u32 {
        let id = uuid::Uuid::now_v7();
        let commit = i % 21 != 20;
        sql.push_str(&format!(
            "START TRANSACTION;\nINSERT INTO {prefix}_orders (total) VALUES ({i});\n\
             CALL {prefix}_enqueue('{subjects}.order-placed.v1', '{{\"n\":{i}}}', 'order-{i}', '{id}', '{{\"content-type\":\"application/json\"}}');\n{};\n",
            if commit { "COMMIT" } else { "ROLLBACK" }
        ));
        if commit {
            committed.insert(id.to_string());
        }
    }
    mariadb(&sql);
    assert_eq!(
        mariadb(&format!("SELECT COUNT(*) FROM {prefix}_orders")).trim(),
        "2000"
    );

    run_ok(outbox().args([
        "--database-url",
        MYSQL,
        "--schema",
        &prefix,
        "relay",
        "--sink",
        NATS,
        "--drain",
        "--batch-size",
        "500",
    ]));

    let info = stream.info().await.unwrap().clone();
    assert_eq!(info.state.messages, 2_000);
    let mut seen = HashSet::new();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        let m = stream.get_raw_message(seq).await.unwrap();
        seen.insert(m.headers.get("Nats-Msg-Id").unwrap().as_str().to_owned());
    }
    assert_eq!(seen, committed);
    let s = status(&prefix);
    assert_eq!(
        (
            s["pending"].as_i64(),
            s["dispatched"].as_i64(),
            s["dead"].as_i64()
        ),
        (Some(0), Some(2_000), Some(0))
    );
    js.delete_stream(&stream_name).await.unwrap();
    drop_tables(&prefix);
}

/// Four producer connections insert (business row + enqueue, REPEATABLE READ as an
/// application has it) while three relay processes drain: producers see no deadlock (1213)
/// or lock-wait (1205) error, and every message id is delivered. Runs
/// `OUTBOX_TEST_PRODUCE_SECONDS` seconds (default 8).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producers_racing_three_relays_never_deadlock() {
    let seconds: u64 = std::env::var("OUTBOX_TEST_PRODUCE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let prefix = unique("mrace");
    run_ok(outbox().args(["--database-url", MYSQL, "--schema", &prefix, "migrate"]));
    mariadb(&format!(
        "CREATE TABLE {prefix}_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, total BIGINT NOT NULL);"
    ));
    let dir = tempfile::tempdir().unwrap();
    let mut relays = Vec::new();
    for r in 0..3 {
        let file = dir.path().join(format!("relay{r}.jsonl"));
        relays.push(
            outbox()
                .args([
                    "--database-url",
                    MYSQL,
                    "--schema",
                    &prefix,
                    "relay",
                    "--sink",
                    &format!("file:{}", file.display()),
                    "--batch-size",
                    "100",
                    "--relay-id",
                    &format!("race-{r}"),
                ])
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
    }

    // An application's pool: default isolation (REPEATABLE READ), its own connections.
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .connect(MYSQL)
        .await
        .unwrap_or_else(|e| panic!("MariaDB must listen on 127.0.0.1:3306 ({e}); {START_MARIADB}"));
    let store = MySqlStore::from_pool(
        pool.clone(),
        StoreConfig {
            schema: Ident::new(&prefix).unwrap(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let errors: Arc<std::sync::Mutex<HashMap<String, u64>>> = Arc::default();
    let ids: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let committed = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut producers = Vec::new();
    for p in 0..4 {
        let (store, pool, errors, ids, committed) = (
            store.clone(),
            pool.clone(),
            errors.clone(),
            ids.clone(),
            committed.clone(),
        );
        let orders = format!("{prefix}_orders");
        producers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                i += 1;
                let attempt = async {
                    let mut tx = pool.begin().await?;
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "INSERT INTO {orders} (total) VALUES (?)"
                    )))
                    .bind(i as i64)
                    .execute(&mut *tx)
                    .await?;
                    let mut last = None;
                    for k in 0..5 {
                        let m = Message::new(
                            "race.order-placed.v1",
                            format!("{p}-{i}-{k}").into_bytes(),
                        )
                        .key(format!("order-{p}-{i}"));
                        store.enqueue(&mut tx, &m).await?;
                        last = Some(m.id().to_string());
                        ids.lock().unwrap().push(m.id().to_string());
                    }
                    tx.commit().await?;
                    Ok::<_, outbox::Error>(last)
                }
                .await;
                match attempt {
                    Ok(_) => {
                        committed.fetch_add(5, Ordering::Relaxed);
                    }
                    Err(e) => {
                        *errors.lock().unwrap().entry(e.to_string()).or_default() += 1;
                    }
                }
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    let errors = errors.lock().unwrap().clone();
    assert!(errors.is_empty(), "producers saw errors: {errors:?}");
    let total = committed.load(Ordering::Relaxed);
    assert!(total > 1_000, "producers made too little progress: {total}");

    let s = wait_for("the relays to drain", Duration::from_secs(60), || {
        let s = status(&prefix);
        (s["pending"] == 0 && s["claimed"] == 0).then_some(s)
    });
    assert_eq!(s["dispatched"].as_u64(), Some(total));
    for mut r in relays {
        // SIGTERM: graceful stop.
        Command::new("kill")
            .arg(r.id().to_string())
            .status()
            .unwrap();
        assert!(r.wait().unwrap().success());
    }
    let mut delivered = HashSet::new();
    let mut per_relay = Vec::new();
    for r in 0..3 {
        let text =
            std::fs::read_to_string(dir.path().join(format!("relay{r}.jsonl"))).unwrap_or_default();
        per_relay.push(text.lines().count());
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            delivered.insert(v["message_id"].as_str().unwrap().to_owned());
        }
    }
    let ids = ids.lock().unwrap();
    assert_eq!(ids.len() as u64, total);
    for id in ids.iter() {
        assert!(delivered.contains(id), "message {id} was never delivered");
    }
    eprintln!(
        "{total} messages in {seconds} s from 4 producers; per relay: {per_relay:?}; no producer errors"
    );
    drop_tables(&prefix);
}
