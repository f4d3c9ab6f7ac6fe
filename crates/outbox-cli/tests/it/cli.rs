//! The `outbox` binary end to end, against the real PostgreSQL and NATS JetStream on this
//! machine (see the README for how to start them).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{Killed, NATS, PG, outbox, run_ok, unique, wait_for};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn psql(sql: &str) -> String {
    let mut child = Command::new("psql")
        .args(["-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", PG])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psql must be installed; PostgreSQL must listen on 127.0.0.1:5432 (start: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start)");
    let _ = child.stdin.take().unwrap().write_all(sql.as_bytes());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "psql failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn status(schema: &str) -> serde_json::Value {
    let out = run_ok(outbox().args(["--database-url", PG, "--schema", schema, "status", "--json"]));
    serde_json::from_str(out.trim()).unwrap()
}

/// The acceptance run: 2,000 committed transactions (and 100 rolled back) that insert a
/// business row and call `outbox.enqueue(...)` from psql; `outbox relay --drain` to
/// JetStream delivers exactly the committed message ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_producers_to_jetstream_exactly_the_committed_ids() {
    let schema = unique("acc");
    // Own subject space: a stream on the shared server may already cover "orders.>".
    let prefix = format!("{schema}.orders");
    run_ok(outbox().args(["--database-url", PG, "--schema", &schema, "migrate"]));
    psql(&format!(
        "CREATE TABLE {schema}.orders (id bigserial PRIMARY KEY, total_cents bigint NOT NULL);"
    ));

    let js = crate::common::jetstream().await;
    let stream_name = schema.to_uppercase();
    let mut stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream_name.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();

    let mut sql = String::new();
    let mut committed = HashSet::new();
    for i in 0..2_100u32 {
        let id = uuid::Uuid::now_v7();
        let commit = i % 21 != 20; // 100 of 2,100 roll back
        sql.push_str(&format!(
            "BEGIN;\nINSERT INTO {schema}.orders (total_cents) VALUES ({i});\n\
             SELECT {schema}.enqueue('{prefix}.order-placed.v1', convert_to('{{\"n\":{i}}}', 'UTF8'), 'order-{i}', '{id}', '{{\"content-type\":\"application/json\"}}');\n{};\n",
            if commit { "COMMIT" } else { "ROLLBACK" }
        ));
        if commit {
            committed.insert(id.to_string());
        }
    }
    psql(&sql);
    assert_eq!(committed.len(), 2_000);
    assert_eq!(
        psql(&format!("SELECT count(*) FROM {schema}.orders")).trim(),
        "2000"
    );

    run_ok(outbox().args([
        "--database-url",
        PG,
        "--schema",
        &schema,
        "relay",
        "--sink",
        NATS,
        "--drain",
        "--batch-size",
        "500",
    ]));

    let info = stream.info().await.unwrap().clone();
    assert_eq!(
        info.state.messages, 2_000,
        "stream holds exactly the committed messages"
    );
    let mut seen = HashSet::new();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        let m = stream.get_raw_message(seq).await.unwrap();
        let id = m.headers.get("Nats-Msg-Id").unwrap().as_str().to_owned();
        assert_eq!(m.headers.get("message-id").unwrap().as_str(), id);
        assert!(m.headers.get("occurred-at").is_some());
        assert_eq!(
            m.headers.get("content-type").unwrap().as_str(),
            "application/json"
        );
        seen.insert(id);
    }
    assert_eq!(seen, committed);

    let s = status(&schema);
    assert_eq!(s["pending"], 0);
    assert_eq!(s["claimed"], 0);
    assert_eq!(s["dispatched"], 2_000);
    assert_eq!(s["dead"], 0);
    assert!(s["oldest_pending_age_seconds"].is_null());

    js.delete_stream(&stream_name).await.unwrap();
    psql(&format!("DROP SCHEMA {schema} CASCADE"));
}

/// 20,000 messages; the relay is SIGKILLed mid-stream and restarted: every message id
/// arrives at least once and every row ends dispatched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_loses_nothing() {
    let schema = unique("kill");
    run_ok(outbox().args(["--database-url", PG, "--schema", &schema, "migrate"]));
    psql(&format!(
        "SELECT {schema}.enqueue('kill.test.v1', convert_to('payload ' || g, 'UTF8'), 'k' || (g % 7))
         FROM generate_series(1, 20000) g;"
    ));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let sink = format!("file:{}", file.display());
    let relay_args = |extra: &[&str]| {
        let mut c = outbox();
        c.args([
            "--database-url",
            PG,
            "--schema",
            &schema,
            "relay",
            "--sink",
            &sink,
            "--batch-size",
            "200",
            "--lease-ms",
            "2000",
            "--publish-timeout-ms",
            "1500",
        ])
        .args(extra);
        c
    };
    let mut child = relay_args(&[]).stdout(Stdio::null()).spawn().unwrap();
    wait_for("the relay's progress", Duration::from_secs(60), || {
        let lines = std::fs::read_to_string(&file)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        (lines >= 4_000).then_some(())
    });
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let before = status(&schema);
    assert!(
        before["dispatched"].as_i64().unwrap() < 20_000,
        "the kill must land mid-stream: {before}"
    );

    run_ok(&mut relay_args(&["--drain"]));
    // Rows the killed relay had claimed come back after the 2 s lease; drain may finish
    // before that, so drain again until nothing is left.
    wait_for("all 20,000 dispatched", Duration::from_secs(30), || {
        if status(&schema)["dispatched"] == 20_000 {
            return Some(());
        }
        run_ok(&mut relay_args(&["--drain"]));
        None
    });

    let text = std::fs::read_to_string(&file).unwrap();
    let mut arrivals: HashMap<String, u32> = HashMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        *arrivals
            .entry(v["message_id"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    let ids = psql(&format!("SELECT message_id FROM {schema}.messages"));
    let ids: Vec<&str> = ids.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(ids.len(), 20_000);
    for id in &ids {
        assert!(arrivals.contains_key(*id), "message {id} never arrived");
    }
    let s = status(&schema);
    assert_eq!(
        (
            s["pending"].as_i64(),
            s["claimed"].as_i64(),
            s["dead"].as_i64()
        ),
        (Some(0), Some(0), Some(0))
    );
    psql(&format!("DROP SCHEMA {schema} CASCADE"));
}

/// The demo runs and adds up.
#[test]
fn demo_adds_up() {
    let out = run_ok(outbox().args(["demo", "--orders", "400"]));
    assert!(out.contains("OK: every committed order"), "{out}");
    assert!(
        out.contains("orders committed                   360"),
        "{out}"
    );
}

/// Clear errors, non-zero exits, nothing written.
#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("x.db").display());

    let out = outbox()
        .args(["--database-url", &db, "status"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("run `outbox migrate`"));

    run_ok(outbox().args(["--database-url", &db, "migrate"]));
    let out = outbox()
        .args([
            "--database-url",
            &db,
            "relay",
            "--sink",
            "kafka+bogus://x",
            "--drain",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid sink URL"));

    let out = outbox()
        .args([
            "--database-url",
            &db,
            "--max-message-bytes",
            "100",
            "enqueue",
            "--topic",
            "t.v1",
            "--payload",
            &"x".repeat(200),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("message too large"));

    let out = outbox()
        .args(["--database-url", "oracle://nope", "status"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported database URL"));

    let s = run_ok(outbox().args(["--database-url", &db, "status", "--json"]));
    let v: serde_json::Value = serde_json::from_str(s.trim()).unwrap();
    assert_eq!(v["pending"], 0, "the refused message was not written");
}

/// `pause` stops `relay --drain` with a clear error; `resume` lets it deliver.
#[test]
fn pause_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("p.db").display());
    run_ok(outbox().args(["--database-url", &db, "migrate"]));
    run_ok(outbox().args([
        "--database-url",
        &db,
        "pause",
        "--reason",
        "broker maintenance",
    ]));
    run_ok(outbox().args([
        "--database-url",
        &db,
        "enqueue",
        "--topic",
        "t.v1",
        "--payload",
        "x",
    ]));
    let out = outbox()
        .args([
            "--database-url",
            &db,
            "relay",
            "--sink",
            "stdout",
            "--drain",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("broker maintenance"));
    let text = run_ok(outbox().args(["--database-url", &db, "status"]));
    assert!(text.contains("PAUSED: broker maintenance"), "{text}");
    let said = crate::common::run(outbox().args(["--database-url", &db, "resume"]));
    assert!(said.status.success());
    assert!(
        String::from_utf8_lossy(&said.stdout).contains("outbox resumed")
            || String::from_utf8_lossy(&said.stderr).contains("outbox resumed")
    );
    // Again: idempotent, and says nothing changed.
    let again = crate::common::run(outbox().args(["--database-url", &db, "resume"]));
    assert!(again.status.success());
    let again = format!(
        "{}{}",
        String::from_utf8_lossy(&again.stdout),
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(
        again.contains("the outbox was not paused: nothing to resume"),
        "{again}"
    );
    let delivered = run_ok(outbox().args([
        "--database-url",
        &db,
        "relay",
        "--sink",
        "stdout",
        "--drain",
    ]));
    assert_eq!(delivered.lines().count(), 1);
}

/// outbox.toml supplies defaults; environment variables and flags override it.
#[test]
fn config_file_then_env_then_flags() {
    let dir = tempfile::tempdir().unwrap();
    let a = format!("sqlite://{}", dir.path().join("a.db").display());
    let b = format!("sqlite://{}", dir.path().join("b.db").display());
    std::fs::write(
        dir.path().join("outbox.toml"),
        format!("database-url = \"{a}\"\n"),
    )
    .unwrap();
    run_ok(outbox().current_dir(dir.path()).arg("migrate"));
    assert!(dir.path().join("a.db").exists());
    run_ok(
        outbox()
            .current_dir(dir.path())
            .env("OUTBOX_DATABASE_URL", &b)
            .arg("migrate"),
    );
    assert!(dir.path().join("b.db").exists());
    let c = format!("sqlite://{}", dir.path().join("c.db").display());
    run_ok(
        outbox()
            .current_dir(dir.path())
            .env("OUTBOX_DATABASE_URL", &b)
            .args(["--database-url", &c, "migrate"]),
    );
    assert!(dir.path().join("c.db").exists());
}

/// Eligibility is decided by the database clock: relays whose clocks are a day ahead or a
/// day behind (libfaketime) deliver a due message at once and a delayed one neither early
/// nor late.
#[test]
fn relay_clock_skew_changes_nothing() {
    let faketime = Command::new("faketime").arg("--version").output();
    assert!(
        faketime.is_ok(),
        "faketime must be installed (apt-get install faketime; scripts/test installs it)"
    );
    let schema = unique("skew");
    run_ok(outbox().args(["--database-url", PG, "--schema", &schema, "migrate"]));
    psql(&format!(
        "SELECT {schema}.enqueue('skew.now.v1', 'a'::bytea);
         SELECT {schema}.enqueue('skew.later.v1', 'b'::bytea, available_at => now() + interval '4 seconds');"
    ));
    let enqueued = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let skewed_relay = |offset: &str| {
        let mut c = Command::new("faketime");
        c.env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env_remove("OUTBOX_DATABASE_URL")
            .env("OUTBOX_LOG", "warn")
            .args(["-f", offset, env!("CARGO_BIN_EXE_outbox")])
            .args([
                "--database-url",
                PG,
                "--schema",
                &schema,
                "relay",
                "--drain",
            ])
            .args(["--sink", &format!("file:{}", file.display())]);
        run_ok(&mut c);
        std::fs::read_to_string(&file)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["topic"].as_str().unwrap().to_owned()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        skewed_relay("+1d"),
        ["skew.now.v1"],
        "a day ahead: only the due one"
    );
    assert!(
        enqueued.elapsed() < Duration::from_secs(4),
        "machine too slow for this check"
    );
    assert_eq!(
        skewed_relay("-1d"),
        ["skew.now.v1"],
        "a day behind: still not the delayed one"
    );
    // The database's clock says the delayed one is due.
    psql(&format!(
        "UPDATE {schema}.messages SET available_at = now() WHERE topic = 'skew.later.v1'"
    ));
    assert_eq!(
        skewed_relay("-1d"),
        ["skew.now.v1", "skew.later.v1"],
        "a day behind: the delayed one once the database says it is due"
    );
    psql(&format!("DROP SCHEMA {schema} CASCADE"));
}

/// `--route` sends each topic to its first matching destination; an unmatched topic is
/// quarantined with "no route for topic" (and the drain exits 4); routes can come from
/// outbox.toml.
#[test]
fn routes_split_topics_between_destinations() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    run_ok(outbox().args(["--database-url", &db, "migrate"]));
    for topic in [
        "orders.placed",
        "orders.placed",
        "audit.user.login",
        "misc.v1",
    ] {
        run_ok(outbox().args([
            "--database-url",
            &db,
            "enqueue",
            "--topic",
            topic,
            "--payload",
            "x",
        ]));
    }
    let a = dir.path().join("orders.jsonl");
    let b = dir.path().join("audit.jsonl");
    std::fs::write(
        dir.path().join("outbox.toml"),
        format!(
            "route = [\"orders.*=file:{}\", \"audit.>=file:{}\"]\n",
            a.display(),
            b.display()
        ),
    )
    .unwrap();
    // The unrouted message is quarantined: the drain says so and exits 4, so a script
    // that checks `$?` sees it.
    let out = outbox()
        .current_dir(dir.path())
        .args(["--database-url", &db, "relay", "--drain"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(
        stderr.contains("1 message was quarantined as dead letters"),
        "{stderr}"
    );
    let lines = |p: &std::path::Path| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .count()
    };
    assert_eq!((lines(&a), lines(&b)), (2, 1));
    let s = run_ok(outbox().args(["--database-url", &db, "status", "--json"]));
    let v: serde_json::Value = serde_json::from_str(s.trim()).unwrap();
    assert_eq!(
        (v["dispatched"].as_i64(), v["dead"].as_i64()),
        (Some(3), Some(1))
    );

    let out = outbox()
        .args([
            "--database-url",
            &db,
            "relay",
            "--route",
            "orders.>x=stdout",
            "--drain",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("must be whole tokens"));
}

/// A purge that finds another purger running (here: its lock held from another session)
/// is not a failure: it stops at once, says so on stderr, exits 0 and touches nothing; once
/// the other purger is gone, the same command deletes the old dispatched rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_that_finds_another_purger_exits_0() {
    use sqlx::Connection as _;
    let schema = unique("purge");
    run_ok(outbox().args(["--database-url", PG, "--schema", &schema, "migrate"]));
    psql(&format!(
        "SELECT {schema}.enqueue('purge.v1', 'x'::bytea) FROM generate_series(1, 3);
         UPDATE {schema}.messages SET status = 2, dispatched_at = now() - interval '30 days';"
    ));
    let mut other = sqlx::PgConnection::connect(PG).await.unwrap();
    // The key the store's purge takes with pg_try_advisory_xact_lock.
    sqlx::query("SELECT pg_advisory_lock(hashtext($1))")
        .bind(format!("outbox-purge-{schema}"))
        .execute(&mut other)
        .await
        .unwrap();

    let out = outbox()
        .args(["--database-url", PG, "--schema", &schema, "purge"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    assert!(
        stderr.contains("another purge is running") && stderr.contains("deleted 0 rows"),
        "{stderr}"
    );
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8(out.stdout).unwrap().trim()).unwrap();
    assert_eq!(v, serde_json::json!({"deleted": 0, "locked_out": true}));
    assert_eq!(status(&schema)["dispatched"], 3, "nothing deleted");

    sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
        .bind(format!("outbox-purge-{schema}"))
        .execute(&mut other)
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(
        run_ok(outbox().args(["--database-url", PG, "--schema", &schema, "purge"])).trim(),
    )
    .unwrap();
    assert_eq!(v, serde_json::json!({"deleted": 3, "locked_out": false}));
    assert_eq!(status(&schema)["dispatched"], 0);
    psql(&format!("DROP SCHEMA {schema} CASCADE"));
}

/// Relay settings out of range (`--min-batch-size` outside 1..=`--batch-size`, a zero
/// batch size, in-flight count, publish timeout or attempt limit, a lease under 30 ms, a
/// largest backoff below the first, a relay id empty or over 255 bytes) are refused by flag name, exit 2, before anything is
/// claimed; a `--batch-size` below the default minimum alone is fine (the minimum
/// follows it).
#[test]
fn relay_refuses_settings_out_of_range() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("s.db").display());
    run_ok(outbox().args(["--database-url", &db, "migrate"]));
    run_ok(outbox().args([
        "--database-url",
        &db,
        "enqueue",
        "--topic",
        "t.v1",
        "--payload",
        "x",
    ]));
    let relay = |extra: &[&str]| {
        outbox()
            .args([
                "--database-url",
                &db,
                "relay",
                "--drain",
                "--sink",
                "stdout",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    for bad in [
        ["--batch-size", "50", "--min-batch-size", "60"],
        ["--batch-size", "50", "--min-batch-size", "0"],
    ] {
        let out = relay(&bad);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(
            stderr.contains("must be from 1 to --batch-size (50)"),
            "{stderr}"
        );
        assert!(out.stdout.is_empty(), "nothing published");
    }
    // Other settings out of range: refused by name, before anything is claimed.
    let long_relay_id = "r".repeat(10 * 1024);
    for (bad, flag) in [
        (&["--relay-id", &long_relay_id][..], "--relay-id"),
        (&["--relay-id", ""][..], "--relay-id"),
        (&["--batch-size", "0"][..], "--batch-size"),
        (&["--lease-ms", "10"][..], "--lease-ms"),
        (&["--in-flight-batches", "0"][..], "--in-flight-batches"),
        (&["--publish-timeout-ms", "0"][..], "--publish-timeout-ms"),
        (&["--max-attempts", "0"][..], "--max-attempts"),
        (
            &["--backoff-max-ms", "10", "--backoff-base-ms", "100"][..],
            "--backoff-max-ms",
        ),
    ] {
        let out = relay(bad);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(stderr.contains(flag), "{bad:?}: {stderr}");
        assert!(out.stdout.is_empty(), "nothing published");
    }
    let out = relay(&["--batch-size", "50"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
}

/// Without a sink (no --sink, OUTBOX_SINK, `sink` key or route) the relay refuses to start
/// with exit 2 and says how to choose one; nothing is dispatched. The same outbox drains
/// once a sink is given, by flag, environment variable or outbox.toml.
#[test]
fn relay_without_a_sink_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("s.db").display());
    run_ok(outbox().args(["--database-url", &db, "migrate"]));
    for _ in 0..3 {
        run_ok(outbox().args([
            "--database-url",
            &db,
            "enqueue",
            "--topic",
            "t.v1",
            "--payload",
            "x",
        ]));
    }
    let out = outbox()
        .current_dir(dir.path())
        .args(["--database-url", &db, "relay", "--drain"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    for hint in [
        "--sink URL",
        "OUTBOX_SINK",
        "sink = \"URL\" in outbox.toml",
        "--route",
        "--sink stdout",
        "JSON line",
    ] {
        assert!(stderr.contains(hint), "no {hint:?} in: {stderr}");
    }
    assert!(out.stdout.is_empty(), "nothing published");
    let pending = |expected: i64| {
        let s = run_ok(outbox().args(["--database-url", &db, "status", "--json"]));
        let v: serde_json::Value = serde_json::from_str(s.trim()).unwrap();
        assert_eq!(v["pending"].as_i64(), Some(expected), "{v}");
    };
    pending(3);

    // Each way of choosing a sink works.
    let printed = run_ok(
        outbox()
            .current_dir(dir.path())
            .env("OUTBOX_SINK", "stdout")
            .args(["--database-url", &db, "relay", "--drain"]),
    );
    assert_eq!(printed.lines().count(), 3);
    pending(0);
    run_ok(outbox().args([
        "--database-url",
        &db,
        "enqueue",
        "--topic",
        "t.v1",
        "--payload",
        "y",
    ]));
    std::fs::write(dir.path().join("outbox.toml"), "sink = \"stdout\"\n").unwrap();
    let printed =
        run_ok(
            outbox()
                .current_dir(dir.path())
                .args(["--database-url", &db, "relay", "--drain"]),
        );
    assert_eq!(printed.lines().count(), 1);
    pending(0);
}

/// A relay "killed" a moment ago (rows claimed with a 3 s lease, never settled): `relay
/// --drain` delivers what is due, exits 0 and says on stderr how many rows other relays
/// still hold and for how long; `--drain-wait-leases` waits for those leases to end and
/// delivers those rows too before it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_reports_and_can_wait_for_leases_held_by_others() {
    use outbox::store::prelude::*;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("l.db").display());
    run_ok(outbox().args(["--database-url", &db, "migrate"]));
    for _ in 0..3 {
        run_ok(outbox().args([
            "--database-url",
            &db,
            "enqueue",
            "--topic",
            "t.v1",
            "--payload",
            "x",
        ]));
    }
    let store = outbox::sqlite::SqliteStore::connect(&db, outbox::StoreConfig::default())
        .await
        .unwrap();
    let lease = Duration::from_secs(3);
    // Taken before the claim: the lease ends at the claim's database time plus the lease,
    // which is no earlier than this.
    let claimed_at = Instant::now();
    let killed = store
        .claim(&outbox::store::ClaimRequest {
            relay_id: "killed".into(),
            batch_size: 2,
            lease,
            skip_topics: Vec::new(),
            ordering: Default::default(),
        })
        .await
        .unwrap();
    assert_eq!(killed.messages.len(), 2);
    let file = dir.path().join("out.jsonl");
    let sink = format!("file:{}", file.display());
    let lines = || {
        std::fs::read_to_string(&file)
            .unwrap_or_default()
            .lines()
            .count()
    };

    let out = outbox()
        .args(["--database-url", &db, "relay", "--sink", &sink, "--drain"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        claimed_at.elapsed() < lease,
        "machine too slow for this check"
    );
    assert_eq!(lines(), 1, "only the unclaimed row was due");
    assert!(
        stderr.contains("2 rows are still claimed by other relays")
            && stderr.contains("leases end within")
            && stderr.contains("--drain-wait-leases"),
        "{stderr}"
    );

    let out = outbox()
        .args([
            "--database-url",
            &db,
            "relay",
            "--sink",
            &sink,
            "--drain-wait-leases",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(claimed_at.elapsed() >= lease, "it waited for the lease");
    assert!(
        stderr.contains("2 rows are claimed by other relays; waiting"),
        "{stderr}"
    );
    assert!(!stderr.contains("still claimed"), "{stderr}");
    assert_eq!(lines(), 3, "the killed relay's rows were delivered");
    let c = store.counts().await.unwrap();
    assert_eq!((c.pending, c.claimed, c.dispatched), (0, 0, 3));
    let l = store.leases().await.unwrap();
    assert_eq!(l.held, 0);
}

/// `outbox inbox purge` deletes only inbox rows older than --older-than, in batches, and
/// refuses ages under the minimum redelivery window (1h) with exit 2, deleting nothing.
#[test]
fn inbox_purge_keeps_young_rows_and_refuses_short_ages() {
    let schema = unique("inbox");
    run_ok(outbox().args(["--database-url", PG, "--schema", &schema, "migrate"]));
    psql(&format!(
        "SELECT {schema}.inbox_accept('billing', gen_random_uuid()) FROM generate_series(1, 8);
         UPDATE {schema}.inbox SET received_at = now() - interval '2 hours'
         WHERE message_id IN (SELECT message_id FROM {schema}.inbox LIMIT 5);"
    ));
    let count = || {
        psql(&format!("SELECT count(*) FROM {schema}.inbox"))
            .trim()
            .to_owned()
    };

    let out = outbox()
        .args(["--database-url", PG, "--schema", &schema])
        .args(["inbox", "purge", "--older-than", "30m"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("minimum inbox retention of 1h"), "{stderr}");
    assert_eq!(count(), "8", "a refused purge deletes nothing");

    let out = run_ok(
        outbox()
            .args(["--database-url", PG, "--schema", &schema])
            .args(["inbox", "purge", "--older-than", "1h", "--batch-size", "2"]),
    );
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v, serde_json::json!({"deleted": 5}));
    assert_eq!(count(), "3", "the young rows stay");
    psql(&format!("DROP SCHEMA {schema} CASCADE"));
}

/// `relay --on-dispatch delete`: everything delivered, no dispatched rows kept.
#[test]
fn a_deleting_relay_keeps_no_dispatched_rows() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("o.db").display());
    let out_file = dir.path().join("out.jsonl");
    run_ok(outbox().args(["--database-url", &db, "migrate"]));
    for i in 0..3 {
        run_ok(outbox().args([
            "--database-url",
            &db,
            "enqueue",
            "--topic",
            "t.delete",
            "--payload",
            &format!("p{i}"),
        ]));
    }
    run_ok(outbox().args([
        "--database-url",
        &db,
        "relay",
        "--sink",
        &format!("file:{}", out_file.display()),
        "--on-dispatch",
        "delete",
        "--drain",
    ]));
    let status: serde_json::Value = serde_json::from_str(
        run_ok(outbox().args(["--database-url", &db, "status", "--json"])).trim(),
    )
    .unwrap();
    assert_eq!(
        (&status["pending"], &status["dispatched"], &status["dead"]),
        (&0.into(), &0.into(), &0.into()),
        "{status}"
    );
    let lines = std::fs::read_to_string(&out_file).unwrap();
    assert_eq!(lines.lines().count(), 3, "{lines}");
    let bad = outbox()
        .args(["--database-url", &db, "relay", "--sink", "stdout"])
        .args(["--on-dispatch", "drop", "--drain"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("keep, delete"));
}

/// Per-key ordering through real relay processes: 10,000 messages over 50 keys, two
/// `outbox relay --ordered` processes with four batches of 10 in flight each to JetStream (a
/// duplicate window of 100 ms, so re-sends show), and one relay SIGKILLed and restarted three
/// times mid-stream. Per key, what the stream holds with duplicates removed by message id
/// (first arrival kept) is in id order, and every message arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_ordered_relays_keep_every_keys_order() {
    const KEYS: u32 = 50;
    const TOTAL: u32 = 10_000;
    let schema = unique("ordkill");
    let prefix = format!("{schema}.o");
    run_ok(outbox().args(["--database-url", PG, "--schema", &schema, "migrate"]));
    let js = crate::common::jetstream().await;
    let stream_name = schema.to_uppercase();
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream_name.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_millis(100), // the least JetStream takes
            ..Default::default()
        })
        .await
        .unwrap();
    // One statement: ids follow g, so each key's sequence numbers follow its ids.
    psql(&format!(
        "SELECT {schema}.enqueue('{prefix}.t', convert_to('k' || (g % {KEYS}) || ':' || (g / {KEYS}), 'UTF8'), 'k' || (g % {KEYS}))
         FROM generate_series(0, {TOTAL} - 1) g;"
    ));
    let relay = |id: &str| {
        let mut c = outbox();
        c.args([
            "--database-url",
            PG,
            "--schema",
            &schema,
            "relay",
            "--sink",
            NATS,
            "--ordered",
            &format!("{prefix}.>"),
            "--relay-id",
            id,
            // Claims of 10 rows: one claim holds at most 10 of the 50 keys, so the two
            // relays' four claims each share the keys and the victim always has some.
            "--batch-size",
            "10",
            "--min-batch-size",
            "10",
            "--in-flight-batches",
            "4",
            "--lease-ms",
            "1500",
            "--poll-interval-ms",
            "100",
        ])
        .stdout(Stdio::null());
        Killed(c.spawn().unwrap())
    };
    let dispatched = || status(&schema)["dispatched"].as_i64().unwrap_or(0);
    // (dispatched rows, rows the relay `id` holds claimed)
    let progress = |id: &str| -> (i64, i64) {
        let out = psql(&format!(
            "SELECT count(*) FILTER (WHERE status = 2), count(*) FILTER (WHERE status <= 1 AND claim_token IS NOT NULL AND claimed_by = '{id}') FROM {schema}.messages"
        ));
        let (d, c) = out.trim().split_once('|').unwrap();
        (d.parse().unwrap(), c.parse().unwrap())
    };
    let steady = relay("steady");
    let mut victim = relay("victim-0");
    let mut held_at_kill = Vec::new();
    for round in 1..=3 {
        // Killed past a quarter, a half, three quarters, while it holds claims.
        let target = i64::from(TOTAL) * round / 4;
        let name = format!("victim-{}", round - 1);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (done, held) = progress(&name);
            if done >= target && held > 0 {
                held_at_kill.push(held);
                break;
            }
            assert!(
                done < i64::from(TOTAL) && Instant::now() < deadline,
                "{name} never held a claim past {target} dispatched ({done} dispatched)"
            );
        }
        victim.0.kill().unwrap(); // SIGKILL
        victim.0.wait().unwrap();
        victim = relay(&format!("victim-{round}"));
    }
    wait_for("every message dispatched", Duration::from_secs(120), || {
        (dispatched() >= i64::from(TOTAL)).then_some(())
    });
    for mut child in [steady, victim] {
        child.0.kill().unwrap();
        child.0.wait().unwrap();
    }

    let info = stream.get_info().await.unwrap();
    let mut first_seen = HashSet::new();
    let mut per_key: HashMap<String, Vec<u32>> = HashMap::new();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        let m = stream.get_raw_message(seq).await.unwrap();
        let id = m.headers.get("Nats-Msg-Id").unwrap().as_str().to_owned();
        if !first_seen.insert(id) {
            continue; // a re-send after a kill
        }
        let body = String::from_utf8(m.payload.to_vec()).unwrap();
        let (key, n) = body.split_once(':').unwrap();
        per_key
            .entry(key.to_owned())
            .or_default()
            .push(n.parse().unwrap());
    }
    assert_eq!(first_seen.len(), TOTAL as usize, "every message arrived");
    assert_eq!(per_key.len(), KEYS as usize);
    for (key, seqs) in &per_key {
        let expected: Vec<u32> = (0..TOTAL / KEYS).collect();
        assert_eq!(seqs, &expected, "key {key} out of order");
    }
    eprintln!(
        "{} messages in the stream for {TOTAL} message ids (re-sends after the kills); rows claimed by the victim at each kill: {held_at_kill:?}",
        info.state.messages
    );
    js.delete_stream(&stream_name).await.unwrap();
    psql(&format!("DROP SCHEMA {schema} CASCADE"));
}
