//! Operating the outbox with the binary: dead letters and audited replay, `status --check`,
//! the relay registry after a SIGKILL, and the Prometheus endpoint checked against what
//! happened (and by `promtool check metrics`). Real SQLite files, the local PostgreSQL and
//! MariaDB.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{
    Killed, MYSQL, PG, free_port, outbox, run, run_ok, run_quarantining, unique, wait_for,
};
use std::collections::BTreeSet;
use std::io::{BufRead, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One outbox to drive: a database URL and the schema (PostgreSQL) or table prefix.
struct Db {
    url: String,
    schema: String,
    _dir: Option<tempfile::TempDir>,
}

impl Db {
    fn sqlite() -> Self {
        let dir = tempfile::tempdir().unwrap();
        Db {
            url: format!("sqlite://{}", dir.path().join("ops.db").display()),
            schema: "outbox".into(),
            _dir: Some(dir),
        }
    }

    fn postgres() -> Self {
        Db {
            url: PG.into(),
            schema: unique("ops"),
            _dir: None,
        }
    }

    fn mariadb() -> Self {
        Db {
            url: MYSQL.into(),
            schema: unique("ops"),
            _dir: None,
        }
    }

    fn cmd(&self) -> Command {
        let mut c = outbox();
        c.args(["--database-url", &self.url, "--schema", &self.schema]);
        c
    }

    /// Runs `sql` on the SQLite file with the `sqlite3` shell (rows written as SQL, the way
    /// another language's producer would).
    fn sqlite_exec(&self, sql: &str) {
        let path = self.url.trim_start_matches("sqlite://");
        let mut sqlite = Command::new("sqlite3")
            .arg(path)
            .stdin(Stdio::piped())
            .spawn()
            .expect("sqlite3 must be installed");
        sqlite
            .stdin
            .take()
            .unwrap()
            .write_all(sql.as_bytes())
            .unwrap();
        assert!(sqlite.wait().unwrap().success());
    }

    fn status(&self) -> serde_json::Value {
        serde_json::from_str(run_ok(self.cmd().args(["status", "--json"])).trim()).unwrap()
    }

    fn enqueue(&self, topic: &str, n: usize) -> Vec<String> {
        (0..n)
            .map(|i| {
                let out = run_ok(self.cmd().args([
                    "enqueue",
                    "--topic",
                    topic,
                    "--payload",
                    &format!("{{\"n\":{i}}}"),
                ]));
                let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
                v["message_id"].as_str().unwrap().to_owned()
            })
            .collect()
    }
}

/// Message ids in a file sink's JSON lines.
fn file_ids(path: &std::path::Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["message_id"].as_str().unwrap().to_owned()
        })
        .collect()
}

/// The acceptance run, on one store: 10 messages quarantined (no route for their
/// topic); `dead list` shows them; `status --check` fails; `replay --dry-run` changes
/// nothing; `replay` (audited) puts them back and, once their route exists, they are
/// delivered with the same message ids; `status --check` passes.
fn dead_letters_round_trip(db: &Db) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    run_ok(db.cmd().arg("migrate"));
    let orders: BTreeSet<String> = db.enqueue("ops.orders.v1", 10).into_iter().collect();
    db.enqueue("ok.ping.v1", 2);
    let ok_route = format!("ok.>=file:{}", out.display());
    run_quarantining(db.cmd().args(["relay", "--drain", "--route", &ok_route]));
    assert_eq!(file_ids(&out).len(), 2);
    let s = db.status();
    assert_eq!(s["dead"], 10, "{s}");
    assert_eq!(s["verdict"]["state"], "DEAD", "{s}");

    let check = run(db.cmd().args(["status", "--check"]));
    assert_eq!(check.status.code(), Some(1), "not OK with dead letters");
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(text.contains("verdict     DEAD: 10 dead letters"), "{text}");

    let listed = run_ok(db.cmd().args(["dead", "list", "--json"]));
    let rows: Vec<serde_json::Value> = listed
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 10);
    let ids: BTreeSet<String> = rows
        .iter()
        .map(|r| r["message_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, orders);
    assert!(
        rows.iter().all(|r| r["last_error"]
            .as_str()
            .unwrap()
            .contains("no route for topic")),
        "{listed}"
    );
    let table = run_ok(db.cmd().args(["dead", "list", "--topic", "ops.>"]));
    assert_eq!(table.lines().count(), 11, "header + 10 rows: {table}");
    let first = rows[0]["id"].as_i64().unwrap().to_string();
    let shown = run_ok(db.cmd().args(["dead", "show", &first, "--payload"]));
    assert!(shown.contains("topic         ops.orders.v1"), "{shown}");
    assert!(shown.contains("payload (UTF-8)\n{\"n\":0}"), "{shown}");

    // Refused before anything changes.
    let no_reason = run(db.cmd().args(["replay", "--topic", "ops.>", "--by", "ci"]));
    assert_eq!(
        no_reason.status.code(),
        Some(2),
        "clap: --reason is required"
    );
    let empty = run(db.cmd().args(["replay", "--reason", "x", "--by", "ci"]));
    assert!(!empty.status.success());
    assert!(
        String::from_utf8_lossy(&empty.stderr).contains("select the dead rows"),
        "{}",
        String::from_utf8_lossy(&empty.stderr)
    );

    let dry = run_ok(db.cmd().args([
        "replay",
        "--topic",
        "ops.>",
        "--reason",
        "route added",
        "--by",
        "ci",
        "--dry-run",
    ]));
    assert!(
        dry.starts_with("dry run: 10 dead rows would be replayed"),
        "{dry}"
    );
    assert_eq!(db.status()["dead"], 10, "a dry run changes nothing");
    // A dry run needs no audit text.
    let dry = run_ok(db.cmd().args(["replay", "--topic", "ops.>", "--dry-run"]));
    assert!(
        dry.starts_with("dry run: 10 dead rows would be replayed"),
        "{dry}"
    );
    let refused = run(db.cmd().args(["replay", "--topic", "ops.>"]));
    assert_eq!(
        refused.status.code(),
        Some(2),
        "the run itself needs --reason and --by"
    );
    assert_eq!(run_ok(db.cmd().args(["replays", "list", "--json"])), "");

    let done = run_ok(db.cmd().args([
        "replay",
        "--topic",
        "ops.>",
        "--reason",
        "route added",
        "--by",
        "ci",
    ]));
    assert!(
        done.starts_with("replayed 10 dead rows (audit id "),
        "{done}"
    );
    let audit: serde_json::Value =
        serde_json::from_str(run_ok(db.cmd().args(["replays", "list", "--json"])).trim()).unwrap();
    assert_eq!(audit["action"], "replay");
    assert_eq!(audit["count"], 10);
    assert_eq!(audit["by"], "ci");
    assert_eq!(audit["reason"], "route added");
    assert_eq!(audit["selection"], "topic=ops.>");

    let orders_route = format!("ops.>=file:{}", out.display());
    run_ok(db.cmd().args([
        "relay",
        "--drain",
        "--route",
        &ok_route,
        "--route",
        &orders_route,
    ]));
    let delivered = file_ids(&out);
    assert!(orders.is_subset(&delivered), "the same message ids");
    assert_eq!(delivered.len(), 12);
    let s = db.status();
    assert_eq!(
        (s["dead"].as_i64(), s["dispatched"].as_i64()),
        (Some(0), Some(12))
    );
    run_ok(db.cmd().args(["status", "--check"]));
}

#[test]
fn dead_letters_round_trip_sqlite() {
    dead_letters_round_trip(&Db::sqlite());
}

#[test]
fn dead_letters_round_trip_postgres() {
    dead_letters_round_trip(&Db::postgres());
}

#[test]
fn dead_letters_round_trip_mariadb() {
    dead_letters_round_trip(&Db::mariadb());
}

/// Selectors that match too much, or nothing sensible, are refused with a clear error.
#[test]
fn replay_refuses_broad_or_bad_selections() {
    let db = Db::sqlite();
    // A 50,000-token pause pattern (PostgreSQL refuses its regex as too complex, failing
    // every claim) and one of 33 short tokens.
    let huge_pattern = vec!["*"; 50_000].join(".");
    let many_tokens = vec!["t"; 33].join(".");
    run_ok(db.cmd().arg("migrate"));
    // 1,001 dead rows, written as SQL.
    let sql = (0..1_001)
        .map(|_| {
            format!(
                "INSERT INTO outbox_messages (message_id, topic, payload, status, last_error) VALUES ('{}', 'bulk.v1', x'00', 3, 'permanent: test');",
                uuid::Uuid::new_v4()
            )
        })
        .collect::<String>();
    db.sqlite_exec(&sql);

    let many = run(db
        .cmd()
        .args([
            "replay", "--topic", "bulk.v1", "--reason", "x", "--by", "ci",
        ])
        .stdin(Stdio::null()));
    assert!(!many.status.success());
    let err = String::from_utf8_lossy(&many.stderr);
    assert!(
        err.contains("1,001 dead rows match and neither --limit nor --yes"),
        "{err}"
    );
    assert_eq!(db.status()["dead"], 1_001, "nothing changed");
    // The dead-row purge asks the same way.
    let purge = run(db
        .cmd()
        .args(["purge", "--dead-older-than", "0s"])
        .stdin(Stdio::null()));
    assert!(!purge.status.success());
    let err = String::from_utf8_lossy(&purge.stderr);
    assert!(
        err.contains("1001 dead rows match and --yes was not given"),
        "{err}"
    );
    // A rate so slow the rows would be parked for years.
    let slow = run(db.cmd().args([
        "replay", "--topic", "bulk.v1", "--reason", "x", "--by", "ci", "--limit", "10", "--rate",
        "1e-300",
    ]));
    assert!(!slow.status.success());
    let err = String::from_utf8_lossy(&slow.stderr);
    assert!(err.contains("at least 0.01 rows per second"), "{err}");
    assert_eq!(db.status()["dead"], 1_001, "nothing changed");
    let limited = run_ok(db.cmd().args([
        "replay", "--topic", "bulk.v1", "--reason", "x", "--by", "ci", "--limit", "10",
    ]));
    assert!(limited.starts_with("replayed 10 dead rows"), "{limited}");
    let rest = run_ok(db.cmd().args([
        "dead",
        "discard",
        "--topic",
        "bulk.v1",
        "--reason",
        "test rows",
        "--by",
        "ci",
        "--yes",
    ]));
    assert!(rest.starts_with("discarded 991 dead rows"), "{rest}");
    // A named row that is not dead is refused, and a dry run exits as the run would.
    db.sqlite_exec(&format!(
        "INSERT INTO outbox_messages (id, message_id, topic, payload) VALUES (5000, '{}', 'live.v1', x'00');",
        uuid::Uuid::new_v4()
    ));
    for dry in [true, false] {
        let mut args = vec!["dead", "discard", "5000", "--reason", "x", "--by", "ci"];
        if dry {
            args.push("--dry-run");
        }
        let refused = run(db.cmd().args(&args));
        let err = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(1), "dry run {dry}: {err}");
        assert!(err.contains("pending, not dead"), "dry run {dry}: {err}");
    }
    assert_eq!(
        db.status()["pending"],
        11,
        "the ten replayed and this one: nothing changed"
    );

    for (args, needle) in [
        (
            vec!["replay", "abc", "--reason", "x", "--by", "ci"],
            "neither a row id",
        ),
        (
            vec!["replay", "--topic", "a..b", "--reason", "x", "--by", "ci"],
            "empty token",
        ),
        (
            vec![
                "replay",
                "--since",
                "yesterday",
                "--reason",
                "x",
                "--by",
                "ci",
            ],
            "neither a duration",
        ),
        (
            vec![
                "replay",
                "--id-range",
                "9..3",
                "--reason",
                "x",
                "--by",
                "ci",
            ],
            "must not exceed",
        ),
        (
            vec!["replay", "--topic", "x", "--reason", "", "--by", "ci"],
            "--reason must not be empty",
        ),
        (vec!["dead", "show", "424242"], "no dead letter with id"),
        (vec!["resume", "--topic", "nope.>"], "no topic pause"),
        (
            vec!["pause", "--topic", "a.\u{1b}[31m", "--reason", "x"],
            "control characters",
        ),
        (
            vec!["pause", "--topic", huge_pattern.as_str(), "--reason", "x"],
            "longer than the 255 bytes",
        ),
        (
            vec!["pause", "--topic", many_tokens.as_str(), "--reason", "x"],
            "33 tokens, more than 32",
        ),
        (vec!["dead", "list", "--limit", "0"], "0 is not in 1.."),
        (
            vec!["relay", "--sink", "stdout", "--metrics-addr", "nonsense"],
            "is not HOST:PORT",
        ),
    ] {
        let out = run(db.cmd().args(&args));
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// A plain HTTP GET of `path` on 127.0.0.1:`port`: (status code, body).
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1.to_owned();
    // Chunked bodies: good enough to drop the chunk size lines for the assertions.
    Some((code, body))
}

/// The value of the one sample of `name` whose labels contain every `labels` pair.
fn sample(scrape: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape.lines().find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        if n != name {
            return None;
        }
        labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            .then(|| value.parse().ok())
            .flatten()
    })
}

fn sigterm(child: &Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
}

/// 1,000 messages through a relay with `--metrics-addr`: the scrape has the counters,
/// histograms and store gauges with the values of what happened, `promtool check metrics`
/// accepts it, `/healthz` and `/readyz` answer 200, and a second relay on the same address
/// is refused at start.
#[test]
fn metrics_scrape_matches_what_happened() {
    let db = Db::sqlite();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    run_ok(db.cmd().arg("migrate"));
    // Enqueue 1,000 in one SQL transaction (faster than 1,000 processes).
    let sql: String = std::iter::once("BEGIN;".to_owned())
        .chain((0..1_000).map(|i| {
            format!(
                "INSERT INTO outbox_messages (message_id, topic, payload) VALUES ('{}', 'm.orders.v1', CAST('{{\"n\":{i}}}' AS BLOB));",
                uuid::Uuid::new_v4()
            )
        }))
        .chain(std::iter::once("COMMIT;".to_owned()))
        .collect();
    db.sqlite_exec(&sql);
    // One more that can never be routed: a quarantine to count.
    db.enqueue("m.unroutable.v1", 1);

    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let route = format!("m.orders.>=file:{}", out.display());
    // Killed when dropped: a failed assertion leaves no relay behind.
    let mut relay = Killed(
        db.cmd()
            .args([
                "relay",
                "--route",
                &route,
                "--metrics-addr",
                &addr,
                "--sample-interval-s",
                "1",
            ])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for("1,000 delivered", Duration::from_secs(60), || {
        (file_ids(&out).len() == 1_000).then_some(())
    });
    let scrape = wait_for(
        "a scrape with the store sample",
        Duration::from_secs(30),
        || {
            let (code, body) = http_get(port, "/metrics")?;
            assert_eq!(code, 200);
            (sample(&body, "outbox_messages", &[("status", "dispatched")]) == Some(1000.0))
                .then_some(body)
        },
    );
    let ok = sample(
        &scrape,
        "outbox_publishes_total",
        &[
            ("outcome", "ok"),
            ("messaging_system", "file"),
            ("reason", "none"),
        ],
    );
    assert_eq!(ok, Some(1000.0), "{scrape}");
    assert_eq!(
        sample(
            &scrape,
            "outbox_publishes_total",
            &[("outcome", "permanent"), ("reason", "no_route")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "outbox_messages_quarantined_total",
            &[("reason", "permanent")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&scrape, "outbox_messages", &[("status", "dead")]),
        Some(1.0)
    );
    assert_eq!(
        sample(&scrape, "outbox_messages", &[("status", "pending")]),
        Some(0.0)
    );
    assert_eq!(sample(&scrape, "outbox_messages_due", &[]), Some(0.0));
    assert_eq!(sample(&scrape, "outbox_relays_alive", &[]), Some(1.0));
    assert_eq!(
        sample(
            &scrape,
            "outbox_dead_messages",
            &[("topic", "m.unroutable.v1")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "outbox_relay_info",
            &[("store", "sqlite"), ("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&scrape, "outbox_destination_state", &[("state", "up")]),
        Some(1.0)
    );
    assert_eq!(
        sample(&scrape, "outbox_messages_retried_total", &[]),
        Some(0.0)
    );
    // Histograms, with buckets: one observation per delivered message.
    for (name, count) in [
        ("outbox_enqueue_to_confirm_seconds_count", Some(1000.0)),
        (
            "outbox_message_confirm_duration_seconds_count",
            Some(1000.0),
        ),
        ("outbox_batch_size_sum", Some(1001.0)),
    ] {
        assert_eq!(sample(&scrape, name, &[]), count, "{name}");
    }
    assert!(
        scrape.contains("# TYPE outbox_publishes_total counter"),
        "{scrape}"
    );
    assert!(scrape.contains("# TYPE outbox_claim_duration_seconds histogram"));
    assert!(scrape.contains("# TYPE outbox_messages gauge"));
    assert!(scrape.contains("outbox_settle_duration_seconds_bucket{le=\"0.005\"}"));
    assert!(scrape.contains("# HELP outbox_oldest_pending_age_seconds"));

    // promtool accepts the scrape as it is.
    let file = dir.path().join("scrape.txt");
    std::fs::write(&file, &scrape).unwrap();
    let promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .expect("promtool must be installed (scripts/test installs Debian's prometheus package)");
    assert!(
        promtool.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&promtool.stdout),
        String::from_utf8_lossy(&promtool.stderr)
    );

    assert_eq!(http_get(port, "/healthz").map(|r| r.0), Some(200));
    assert_eq!(http_get(port, "/readyz").map(|r| r.0), Some(200));

    // The address is taken: a second relay says so and exits at once.
    let second = run(db
        .cmd()
        .args(["relay", "--sink", "stdout", "--metrics-addr", &addr]));
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(
        err.contains(&format!("--metrics-addr {addr}: cannot listen there")),
        "{err}"
    );

    sigterm(&relay);
    assert!(relay.wait().unwrap().success());
    let mut log = String::new();
    relay
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(!log.contains("ERROR"), "{log}");
}

/// A TCP listener that accepts connections and never answers (an HTTP sink's requests
/// hang there), so a relay holds its claims until it is killed.
fn black_hole() -> (u16, std::thread::JoinHandle<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in l.incoming().flatten() {
            held.push(s);
            if held.len() > 64 {
                break;
            }
        }
    });
    (port, t)
}

/// A relay killed with SIGKILL disappears from `status` within the registry's expiry (15
/// s), its claims are reported as held by a relay that is not alive until they are
/// claimed again, and the verdict names it.
#[test]
fn a_killed_relay_leaves_the_registry_and_its_claims_are_reported() {
    let db = Db::postgres();
    run_ok(db.cmd().arg("migrate"));
    db.enqueue("kill.v1", 5);
    let (port, _hole) = black_hole();
    let mut relay = db
        .cmd()
        .args([
            "relay",
            "--sink",
            &format!("http://127.0.0.1:{port}/hook"),
            "--relay-id",
            "doomed-relay",
            "--lease-ms",
            "4000",
            "--publish-timeout-ms",
            "60000",
        ])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let s = wait_for(
        "the relay registered with its claims",
        Duration::from_secs(20),
        || {
            let s = db.status();
            (s["relays"].as_array()?.len() == 1 && s["claimed"] == 5).then_some(s)
        },
    );
    assert_eq!(s["relays"][0]["relay_id"], "doomed-relay");
    let text = run_ok(db.cmd().arg("status"));
    assert!(
        text.contains("relays      1 alive\n  doomed-relay"),
        "{text}"
    );

    relay.kill().unwrap();
    relay.wait().unwrap();
    let killed = Instant::now();
    let stuck = || -> serde_json::Value {
        serde_json::from_str(
            run_ok(db.cmd().args(["status", "--json", "--stuck-after", "5s"])).trim(),
        )
        .unwrap()
    };
    let s = wait_for(
        "the registry row to expire",
        Duration::from_secs(25),
        || {
            let s = stuck();
            s["relays"].as_array()?.is_empty().then_some(s)
        },
    );
    let gone_after = killed.elapsed();
    assert!(
        gone_after <= Duration::from_secs(16),
        "expired after {gone_after:?}"
    );
    // Its claims: held by a relay that is not alive, their lease (4 s) ended by now.
    let gone = s["claims_of_gone_relays"].as_array().unwrap();
    assert_eq!(gone.len(), 1, "{s}");
    assert_eq!(gone[0]["relay_id"], "doomed-relay");
    assert_eq!(
        (gone[0]["claimed"].as_i64(), gone[0]["expired"].as_i64()),
        (Some(5), Some(5))
    );
    assert_eq!(s["verdict"]["state"], "STUCK", "{s}");
    assert_eq!(
        s["verdict"]["text"],
        format!(
            "5 messages due for {} s and no relay is alive",
            s["oldest_due_seconds"]
        )
    );
    let text = run_ok(db.cmd().args(["status", "--stuck-after", "5s"]));
    assert!(
        text.contains("verdict     STUCK: 5 messages due for "),
        "{text}"
    );
    assert!(
        text.contains("claimed by doomed-relay (not alive): 5 rows, 5 with an ended lease"),
        "{text}"
    );
    let check = run(db.cmd().args(["status", "--check", "--stuck-after", "5s"]));
    assert_eq!(check.status.code(), Some(1));

    // Another relay takes them over: no claims of gone relays remain.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    run_ok(db.cmd().args([
        "relay",
        "--drain",
        "--sink",
        &format!("file:{}", out.display()),
    ]));
    assert_eq!(file_ids(&out).len(), 5);
    let s = db.status();
    assert!(
        s["claims_of_gone_relays"].as_array().unwrap().is_empty(),
        "{s}"
    );
    run_ok(db.cmd().args(["status", "--check"]));
}

/// A topic pause from the CLI holds only its topics while a relay runs; status lists it
/// with who and why; resume lets them flow.
#[test]
fn pause_by_topic_holds_only_its_topics() {
    let db = Db::sqlite();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    run_ok(db.cmd().arg("migrate"));
    run_ok(db.cmd().args([
        "pause",
        "--topic",
        "billing.>",
        "--reason",
        "consumer redeploy",
        "--by",
        "dana",
    ]));
    let text = run_ok(db.cmd().arg("status"));
    assert!(
        text.contains("topic paused: billing.>  by dana at "),
        "{text}"
    );
    assert!(
        text.ends_with(
            "consumer redeploy\nverdict     OK (1 topic pause in force: their rows wait)\n"
        ),
        "{text}"
    );
    let held: BTreeSet<String> = db.enqueue("billing.invoice.v1", 3).into_iter().collect();
    // A drain leaves the paused topic's rows pending, and names the pause as the reason.
    let drain = db
        .cmd()
        .args([
            "relay",
            "--sink",
            &format!("file:{}", out.display()),
            "--drain",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&drain.stderr);
    assert!(drain.status.success(), "{stderr}");
    assert!(
        stderr.contains("with 3 rows still pending")
            && stderr.contains("topics paused (their rows stay pending until `outbox resume --topic PATTERN`): billing.>"),
        "{stderr}"
    );
    assert!(file_ids(&out).is_empty());
    let flows: BTreeSet<String> = db.enqueue("orders.placed.v1", 3).into_iter().collect();
    let mut relay = db
        .cmd()
        .env("OUTBOX_LOG", "info")
        .args([
            "relay",
            "--sink",
            &format!("file:{}", out.display()),
            "--summary-interval-s",
            "1",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        "the unpaused topic delivered",
        Duration::from_secs(20),
        || (file_ids(&out) == flows).then_some(()),
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(file_ids(&out), flows, "nothing of the paused topic");
    run_ok(db.cmd().args(["resume", "--topic", "billing.>"]));
    wait_for(
        "the paused topic after resume",
        Duration::from_secs(20),
        || (file_ids(&out).len() == 6).then_some(()),
    );
    assert!(held.is_subset(&file_ids(&out)));
    sigterm(&relay);
    assert!(relay.wait().unwrap().success());
    let log = std::io::BufReader::new(relay.stderr.take().unwrap())
        .lines()
        .map(|l| l.unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(log.contains("topics paused: not publishing these"), "{log}");
    assert!(log.contains("topic pauses lifted"), "{log}");
    // The summary line, once a second here: what was delivered, and the backlog.
    let summary = log
        .lines()
        .find(|l| l.contains("relay summary") && l.contains("delivered=3"))
        .unwrap_or_else(|| panic!("no summary line with delivered=3: {log}"));
    assert!(summary.contains("backlog=3"), "{summary}");
    assert!(summary.contains("destinations_down=none"), "{summary}");
}

/// Per-key ordering from the binary (SQLite): a dead letter written first for key k1 of an
/// ordered topic holds k1's later messages while k2 flows; `dead list --ordered` marks it
/// BLOCKS with the two waiting behind it; discarding it (audited) lets k1 through, in
/// order.
#[test]
fn an_ordered_relay_holds_a_key_behind_its_dead_letter() {
    let db = Db::sqlite();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    run_ok(db.cmd().arg("migrate"));
    db.sqlite_exec(&format!(
        "INSERT INTO outbox_messages (message_id, topic, key, payload, status, last_error) VALUES ('{}', 'o.t', 'k1', x'00', 3, 'permanent: refused');",
        uuid::Uuid::new_v4()
    ));
    let enqueue = |key: &str, payload: &str| {
        run_ok(db.cmd().args([
            "enqueue",
            "--topic",
            "o.t",
            "--key",
            key,
            "--payload",
            payload,
        ]));
    };
    enqueue("k1", "k1:1");
    enqueue("k1", "k1:2");
    enqueue("k2", "k2:0");
    let sink = format!("file:{}", out.display());
    let relay = ["relay", "--drain", "--sink", &sink, "--ordered", "o.>"];
    let drained = run(db.cmd().args(relay));
    assert!(drained.status.success());
    let said = String::from_utf8_lossy(&drained.stderr);
    assert!(
        said.contains("2 of them wait behind the dead letters of 1 ordered key:"),
        "{said}"
    );
    let payloads = || -> Vec<String> {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["payload"].as_str().unwrap().to_owned()
            })
            .collect()
    };
    assert_eq!(payloads(), vec!["k2:0"], "k1 waits behind its dead letter");
    let s = db.status();
    assert_eq!(
        (s["pending"].as_i64(), s["dead"].as_i64()),
        (Some(2), Some(1)),
        "{s}"
    );

    let status = |args: &[&str]| -> serde_json::Value {
        let out = run(db
            .cmd()
            .args(["status", "--json", "--stuck-after", "0s"])
            .args(args));
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap()
    };
    let st = status(&["--ordered", "o.>"]);
    assert_eq!(st["verdict"]["state"], "BLOCKED", "{st}");
    assert_eq!(st["ordered_held"], 2, "{st}");
    assert_eq!(st["ordered_blocked_keys"], 1, "{st}");
    // The drain's relay parked them: without --ordered, status still sees them waiting.
    let unaware = status(&[]);
    assert_eq!(
        (
            &unaware["verdict"]["state"],
            &unaware["parked"],
            &unaware["due"]
        ),
        (
            &serde_json::json!("BLOCKED"),
            &serde_json::json!(2),
            &serde_json::json!(0)
        ),
        "without --ordered: {unaware}"
    );
    let listed = run_ok(
        db.cmd()
            .args(["dead", "list", "--ordered", "o.>", "--json"]),
    );
    let row: serde_json::Value = serde_json::from_str(listed.trim()).unwrap();
    assert_eq!(row["blocking"], true, "{row}");
    assert_eq!(row["waiting_behind"], 2, "{row}");
    let table = run_ok(db.cmd().args(["dead", "list", "--ordered", "o.>"]));
    assert!(
        table.lines().nth(1).unwrap().contains("     2  BLOCKS"),
        "{table}"
    );
    let unordered = run_ok(db.cmd().args(["dead", "list", "--json"]));
    assert!(unordered.contains("\"blocking\":false"), "{unordered}");

    let id = row["id"].as_i64().unwrap().to_string();
    run_ok(db.cmd().args([
        "dead",
        "discard",
        &id,
        "--reason",
        "never valid",
        "--by",
        "ci",
        "--yes",
    ]));
    run_ok(db.cmd().args(relay));
    assert_eq!(payloads(), vec!["k2:0", "k1:1", "k1:2"]);
    let audit = run_ok(db.cmd().args(["replays", "list", "--json"]));
    assert!(audit.contains("never valid"), "{audit}");
}

/// `status --ordered`: rows that are due but wait behind their key's first row, which is
/// not due yet (a delayed message, a retry's backoff), are held by per-key ordering,
/// neither stuck nor late: with no relay alive, the verdict is OK while every due row is
/// held (and says how many are), and a fresh row that nothing holds is judged by its own
/// age (STUCK once it has been due for `--stuck-after`, counting only it). A delayed
/// message written long ago is not BEHIND until it has been due for `--max-age`.
#[test]
fn rows_behind_a_key_head_not_due_are_neither_stuck_nor_late() {
    let db = Db::sqlite();
    run_ok(db.cmd().arg("migrate"));
    let enqueue = |key: &str| {
        run_ok(
            db.cmd()
                .args(["enqueue", "--topic", "o.t", "--key", key, "--payload", "x"]),
        );
    };
    enqueue("k1");
    enqueue("k1");
    enqueue("k1");
    // k1's first row waits an hour (as a retry's backoff would); its others have been
    // due for ten minutes, written two hours ago.
    db.sqlite_exec(
        "UPDATE outbox_messages SET occurred_at = occurred_at - 7200000,
           available_at = available_at - 600000;
         UPDATE outbox_messages SET available_at = available_at + 4200000
         WHERE id = (SELECT min(id) FROM outbox_messages);",
    );
    let status = |args: &[&str]| -> (Option<i32>, serde_json::Value) {
        let out = run(db
            .cmd()
            .args(["status", "--json", "--check", "--stuck-after", "60s"])
            .args(["--max-age", "120s"])
            .args(args));
        let v = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
        (out.status.code(), v)
    };
    let (code, st) = status(&["--ordered", "o.>"]);
    assert_eq!(st["due"], 2, "{st}");
    assert_eq!(st["ordered_due_held"], 2, "{st}");
    assert_eq!(st["verdict"]["state"], "OK", "{st}");
    assert_eq!(code, Some(0), "{st}");
    let text = run_ok(db.cmd().args(["status", "--ordered", "o.>"]));
    assert!(
        text.contains(
            "held by order       2 of the due rows wait behind an earlier row of their key"
        ),
        "{text}"
    );
    // Without --ordered, status cannot know they are held: unordered relays would take
    // them, so they are stuck.
    let (code, st) = status(&[]);
    assert_eq!(st["verdict"]["state"], "STUCK", "{st}");
    assert_eq!(st["ordered_due_held"], serde_json::Value::Null, "{st}");
    assert_eq!(code, Some(1));
    // A fresh row of another key: due for less than --stuck-after, so not stuck yet,
    // however long the held ones have been due.
    enqueue("k2");
    let (code, st) = status(&["--ordered", "o.>"]);
    assert_eq!(st["verdict"]["state"], "OK", "{st}");
    assert_eq!(code, Some(0));
    // Due for 90 s: stuck, counting only it, with its own age.
    db.sqlite_exec(
        "UPDATE outbox_messages SET available_at = available_at - 90000
         WHERE id = (SELECT max(id) FROM outbox_messages);",
    );
    let (code, st) = status(&["--ordered", "o.>"]);
    assert_eq!(st["verdict"]["state"], "STUCK", "{st}");
    let said = st["verdict"]["text"].as_str().unwrap();
    assert!(said.starts_with("1 message due for 9"), "{st}");
    assert!(!said.contains("600"), "the held rows' age is not its: {st}");
    assert_eq!(code, Some(1));

    // A message delayed by an hour, written two hours ago, with a relay claiming: not
    // late (BEHIND counts from when a message is due).
    let db = Db::sqlite();
    run_ok(db.cmd().arg("migrate"));
    enqueue_on(&db, "later");
    db.sqlite_exec(
        "UPDATE outbox_messages SET occurred_at = occurred_at - 7200000,
           available_at = available_at + 3600000;",
    );
    let out = run(db
        .cmd()
        .args(["status", "--json", "--check", "--max-age", "60s"]));
    let st: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert!(
        st["oldest_pending_age_seconds"].as_i64().unwrap() >= 7_200,
        "{st}"
    );
    assert_eq!(st["verdict"]["state"], "OK", "{st}");
    assert_eq!(out.status.code(), Some(0));
}

fn enqueue_on(db: &Db, topic: &str) {
    run_ok(
        db.cmd()
            .args(["enqueue", "--topic", topic, "--payload", "x"]),
    );
}

/// `dead list --ordered`'s footer counts the messages waiting behind a key once, however
/// many of its dead letters are listed.
#[test]
fn dead_list_counts_a_keys_waiting_messages_once() {
    let db = Db::sqlite();
    run_ok(db.cmd().arg("migrate"));
    db.sqlite_exec(
        "INSERT INTO outbox_messages (id, message_id, topic, key, payload, status) VALUES
           (1, '00000000-0000-7000-8000-000000000001', 'o.t', 'k1', x'00', 3),
           (2, '00000000-0000-7000-8000-000000000002', 'o.t', 'k1', x'00', 3),
           (3, '00000000-0000-7000-8000-000000000003', 'o.t', 'k1', x'00', 0);",
    );
    let out = run(db.cmd().args(["dead", "list", "--ordered", "o.>"]));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("2 dead letters block their keys (1 later message waits)"),
        "{said}"
    );
}

/// Passwords from files (`OUTBOX_DATABASE_PASSWORD_FILE`, `OUTBOX_SINK_PASSWORD_FILE`)
/// never show: not in the relay's log (at debug, with the summary line every second), not
/// in `status` (text and JSON, which carry the relay registry's sink summary), not in the
/// metrics scrape, and not in the error of a store that cannot be reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_from_files_never_show() {
    const DB_PASS: &str = "SECRET-DBPASS-41d2";
    const SINK_PASS: &str = "SECRET-SINKPASS-8e0b";
    let db = Db::postgres();
    let dir = tempfile::tempdir().unwrap();
    let db_file = dir.path().join("db-password");
    let sink_file = dir.path().join("sink-password");
    std::fs::write(&db_file, format!("{DB_PASS}\n")).unwrap();
    std::fs::write(&sink_file, SINK_PASS).unwrap();
    let with_files = |mut c: Command| {
        c.env("OUTBOX_DATABASE_PASSWORD_FILE", &db_file)
            .env("OUTBOX_SINK_PASSWORD_FILE", &sink_file)
            .env("OUTBOX_LOG", "debug");
        c
    };
    let subject = unique("secretfiles");
    let js = crate::common::jetstream().await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: subject.clone(),
        subjects: vec![format!("{subject}.>")],
        ..Default::default()
    })
    .await
    .unwrap();

    let mut seen = String::new();
    let capture = |seen: &mut String, out: std::process::Output| {
        seen.push_str(&String::from_utf8_lossy(&out.stdout));
        seen.push_str(&String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{seen}");
    };
    capture(
        &mut seen,
        with_files(db.cmd()).arg("migrate").output().unwrap(),
    );
    for i in 0..3 {
        capture(
            &mut seen,
            with_files(db.cmd())
                .args(["enqueue", "--topic", &format!("{subject}.t"), "--payload"])
                .arg(format!("{{\"n\":{i}}}"))
                .output()
                .unwrap(),
        );
    }
    let port = free_port();
    let mut relay = with_files(db.cmd())
        .args(["relay", "--sink", "nats://outbox@127.0.0.1:4222"])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .args(["--summary-interval-s", "1", "--sample-interval-s", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The relay's log, as it is written.
    let logged = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let log_reader = {
        let (logged, mut stderr) = (logged.clone(), relay.stderr.take().unwrap());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stderr.read(&mut buf) {
                logged
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };
    wait_for("3 dispatched", Duration::from_secs(30), || {
        (db.status()["dispatched"] == 3).then_some(())
    });
    let scrape = wait_for("a scrape", Duration::from_secs(30), || {
        let (code, body) = http_get(port, "/metrics")?;
        (code == 200 && body.contains("outbox_relay_info")).then_some(body)
    });
    seen.push_str(&scrape);
    wait_for("the relay's summary line", Duration::from_secs(30), || {
        logged
            .lock()
            .unwrap()
            .contains("relay summary")
            .then_some(())
    });
    let status = wait_for(
        "the relay's sink in status",
        Duration::from_secs(30),
        || {
            let out = with_files(db.cmd()).arg("status").output().unwrap();
            String::from_utf8_lossy(&out.stdout)
                .contains("nats://outbox")
                .then_some(out)
        },
    );
    capture(&mut seen, status);
    capture(
        &mut seen,
        with_files(db.cmd())
            .args(["status", "--json"])
            .output()
            .unwrap(),
    );
    assert!(
        seen.contains("nats://outbox"),
        "the relay's sink in status: {seen}"
    );
    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    let out = relay.wait_with_output().unwrap();
    log_reader.join().unwrap();
    seen.push_str(&String::from_utf8_lossy(&out.stdout));
    seen.push_str(&logged.lock().unwrap());
    assert!(
        seen.contains("delivered"),
        "the summary line was logged: {seen}"
    );

    // A store that cannot be reached: the error names the URL, not the password.
    let unreachable = with_files(outbox())
        .args([
            "--database-url",
            "postgres://postgres@127.0.0.1:1/test",
            "status",
        ])
        .output()
        .unwrap();
    assert!(!unreachable.status.success());
    let err = String::from_utf8_lossy(&unreachable.stderr).into_owned();
    assert!(err.contains("127.0.0.1:1"), "{err}");
    seen.push_str(&err);

    for marker in [DB_PASS, SINK_PASS] {
        assert!(!seen.contains(marker), "{marker} showed in:\n{seen}");
    }
    // The file is read: one that is missing is an error naming it.
    let missing = db
        .cmd()
        .env("OUTBOX_DATABASE_PASSWORD_FILE", dir.path().join("nope"))
        .arg("status")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success() && err.contains("nope"), "{err}");
    let _ = js.delete_stream(&subject).await;
}

/// A default CA (`OUTBOX_TLS_CA_FILE`) that cannot be read does not stop a plain-text sink
/// that never uses it; a TLS sink, which would, is refused at start naming the file.
#[test]
fn a_missing_default_ca_matters_only_to_tls_sinks() {
    let db = Db::sqlite();
    run_ok(db.cmd().arg("migrate"));
    let drain = |sink: &str| {
        db.cmd()
            .env("OUTBOX_TLS_CA_FILE", "/nonexistent/outbox-ca.pem")
            .args(["relay", "--sink", sink, "--drain"])
            .output()
            .unwrap()
    };
    let plain = drain("nats://127.0.0.1:4222");
    assert!(
        plain.status.success(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    let tls = drain("tls://127.0.0.1:4222");
    let err = String::from_utf8_lossy(&tls.stderr);
    assert!(
        !tls.status.success() && err.contains("outbox-ca.pem"),
        "{err}"
    );
}

/// A session with a REPEATABLE READ snapshot held open (psql, idle in transaction) holds
/// back the cleanup of the outbox's dispatched rows: `status` prints the oldest
/// transaction's line and `--json` its `cleanup_horizon`, and a relay exports its age as
/// `outbox_oldest_transaction_age_seconds`. Other tests share the server and may hold
/// transactions of their own: ages are lower bounds.
#[test]
fn a_held_snapshot_shows_in_status_and_metrics() {
    let db = Db::postgres();
    run_ok(db.cmd().arg("migrate"));
    let mut psql = Command::new("psql")
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", PG])
        .env("PGAPPNAME", "held_snapshot_test")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("psql must be installed");
    let mut stdin = psql.stdin.take().unwrap();
    writeln!(
        stdin,
        "BEGIN ISOLATION LEVEL REPEATABLE READ;\nSELECT 'held:' || pg_backend_pid();"
    )
    .unwrap();
    let mut line = String::new();
    let mut out = std::io::BufReader::new(psql.stdout.take().unwrap());
    while !line.contains("held:") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "psql ended");
    }
    let pid: i64 = line.trim().trim_start_matches("held:").parse().unwrap();
    let began = Instant::now();
    let held = Duration::from_secs(2);
    wait_for(
        "the snapshot reported held for 2 s",
        held + Duration::from_secs(5),
        || {
            let age = db.status()["cleanup_horizon"]["oldest"]["age_s"].as_f64()?;
            (age >= held.as_secs_f64()).then_some(())
        },
    );

    let text = run_ok(db.cmd().arg("status"));
    let line = text
        .lines()
        .find(|l| l.starts_with("oldest transaction"))
        .unwrap_or_else(|| panic!("no oldest transaction line:\n{text}"));
    assert!(line.contains("pid "), "{line}");
    if line.contains(&format!("pid {pid},")) {
        assert!(line.contains("application held_snapshot_test"), "{line}");
        assert!(line.contains("idle in transaction"), "{line}");
    }
    let j = db.status();
    let oldest = &j["cleanup_horizon"]["oldest"];
    assert!(
        oldest["age_s"].as_f64().unwrap() >= held.as_secs_f64(),
        "{j}"
    );
    assert!(j["cleanup_horizon"]["xmin_age"].as_i64().is_some(), "{j}");

    let port = free_port();
    let mut relay = db
        .cmd()
        .args([
            "relay",
            "--sink",
            "stdout",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let scrape = wait_for("the store sample", Duration::from_secs(30), || {
        let (_, body) = http_get(port, "/metrics")?;
        sample(&body, "outbox_oldest_transaction_age_seconds", &[]).map(|_| body)
    });
    let age = sample(&scrape, "outbox_oldest_transaction_age_seconds", &[]).unwrap();
    assert!(
        age >= held.as_secs_f64(),
        "held {:?}, gauge {age}",
        began.elapsed()
    );
    assert!(sample(&scrape, "outbox_oldest_xmin_age_transactions", &[]).is_some());
    assert!(scrape.contains("# HELP outbox_oldest_transaction_age_seconds"));
    sigterm(&relay);
    relay.wait().unwrap();
    drop(stdin);
    psql.wait().unwrap();
}

/// The relays of the registry under `relay_id`, as `status --json` lists them: (host, pid).
fn registered(db: &Db, relay_id: &str) -> Vec<(String, i64)> {
    db.status()["relays"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["relay_id"] == relay_id)
        .map(|r| {
            (
                r["host"].as_str().unwrap().to_owned(),
                r["pid"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// A second relay process under the id of a live one is refused at start (exit 2, naming
/// the holder); after a `kill -9` a restart under the same id on this host starts at once
/// (the dead pid's registry row does not hold the id) and the registry shows the new
/// process.
#[test]
fn a_second_relay_under_a_live_id_is_refused() {
    let db = Db::postgres();
    run_ok(db.cmd().arg("migrate"));
    let start = || {
        db.cmd()
            .args(["relay", "--sink", "stdout", "--relay-id", "dup-relay"])
            // At info, so the test sees whether a refused relay says it started.
            .env("OUTBOX_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut first = start();
    let first_pid = i64::from(first.id());
    wait_for(
        "the first relay registered",
        Duration::from_secs(20),
        || {
            registered(&db, "dup-relay")
                .iter()
                .any(|r| r.1 == first_pid)
                .then_some(())
        },
    );

    let mut second = start();
    let exited = wait_for("the second relay to exit", Duration::from_secs(20), || {
        let done = second.try_wait().unwrap().is_some();
        if !done && registered(&db, "dup-relay").len() > 1 {
            let _ = second.kill();
        }
        Some(done)
            .filter(|d| *d)
            .or_else(|| (registered(&db, "dup-relay").len() > 1).then_some(false))
    });
    if !exited {
        let _ = second.kill();
        let _ = first.kill();
        panic!("a second relay under a live relay's id was not refused");
    }
    let second = second.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{err}");
    assert!(
        err.contains("relay id \"dup-relay\" is in use by a live relay")
            && err.contains(&format!("(pid {first_pid},")),
        "{err}"
    );
    assert!(
        !err.contains("relay started"),
        "a refused relay must not log that it started: {err}"
    );
    assert_eq!(
        registered(&db, "dup-relay")
            .iter()
            .map(|r| r.1)
            .collect::<Vec<_>>(),
        vec![first_pid]
    );

    // kill -9: the registry row stays fresh for up to 15 s; the restart is not refused.
    first.kill().unwrap();
    first.wait().unwrap();
    let mut third = start();
    let third_pid = i64::from(third.id());
    wait_for(
        "the restarted relay registered",
        Duration::from_secs(20),
        || {
            assert!(
                third.try_wait().unwrap().is_none(),
                "the restart under the dead relay's id exited"
            );
            (registered(&db, "dup-relay")
                .iter()
                .map(|r| r.1)
                .collect::<Vec<_>>()
                == vec![third_pid])
            .then_some(())
        },
    );
    sigterm(&third);
    third.wait().unwrap();
}

/// Two relays that both passed the start check (here: a registry row of another relay
/// instance, as another host's process would write it, with a fresh heartbeat) are seen at the next
/// heartbeat: an ERROR log line and `outbox_relay_id_conflicts_total`.
#[test]
fn a_relay_id_taken_after_start_is_reported_at_the_next_heartbeat() {
    let db = Db::postgres();
    run_ok(db.cmd().arg("migrate"));
    let port = free_port();
    let relay = db
        .cmd()
        .args([
            "relay",
            "--sink",
            "stdout",
            "--relay-id",
            "raced-relay",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the relay registered", Duration::from_secs(20), || {
        (!registered(&db, "raced-relay").is_empty()).then_some(())
    });
    let scrape = wait_for("the scrape", Duration::from_secs(20), || {
        http_get(port, "/metrics").map(|r| r.1)
    });
    assert_eq!(
        sample(&scrape, "outbox_relay_id_conflicts_total", &[]),
        Some(0.0),
        "{scrape}"
    );
    db.sql(
        "INSERT INTO {relays} (relay_id, instance, host, pid, version, sink, in_flight)
         VALUES ('raced-relay', 'an-instance-elsewhere', 'elsewhere', 4242, '0.1.0', 'stdout', 0);",
    );
    wait_for("the conflict counted", Duration::from_secs(20), || {
        let (_, body) = http_get(port, "/metrics")?;
        (sample(&body, "outbox_relay_id_conflicts_total", &[])? >= 1.0).then_some(())
    });
    sigterm(&relay);
    let out = relay.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ERROR") && err.contains("another live relay runs under this relay id"),
        "{err}"
    );
}

impl Db {
    /// Runs `sql` on this outbox's database with its shell client (`sqlite3`, `psql`,
    /// `mariadb`); `{relays}` in it names the registry table.
    fn sql(&self, sql: &str) {
        if self.url.starts_with("sqlite:") {
            // Waits for the relay's write lock instead of failing on it.
            let sql = format!(
                ".timeout 10000\n{}",
                sql.replace("{relays}", "outbox_relays")
            );
            return self.sqlite_exec(&sql);
        }
        let (program, args, table): (&str, Vec<&str>, String) = if self.url.starts_with("mysql:") {
            (
                "mariadb",
                vec!["-h", "127.0.0.1", "-u", "root", "test"],
                format!("{}_relays", self.schema),
            )
        } else {
            (
                "psql",
                vec!["-X", "-q", "-v", "ON_ERROR_STOP=1", PG],
                format!("{}.relays", self.schema),
            )
        };
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(sql.replace("{relays}", &table).as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{program}: {out:?}");
    }

    /// The database clock as the registry keeps it (an SQL expression).
    fn now_sql(&self) -> &'static str {
        if self.url.starts_with("sqlite:") {
            "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
        } else if self.url.starts_with("mysql:") {
            "UTC_TIMESTAMP(6)"
        } else {
            "now()"
        }
    }
}

/// Two relays under one id that both passed the start check (here: a live registry row
/// of another relay instance on another host, written as that relay would) are listed
/// each with its host, pid and start, and the id is marked as conflicting; stopping the
/// local relay removes only its own row.
fn two_relays_under_one_id_are_each_listed(db: &Db) {
    run_ok(db.cmd().arg("migrate"));
    let relay = db
        .cmd()
        .args(["relay", "--sink", "stdout", "--relay-id", "twin-relay"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = i64::from(relay.id());
    wait_for("the relay registered", Duration::from_secs(20), || {
        (!registered(db, "twin-relay").is_empty()).then_some(())
    });
    let now = db.now_sql();
    db.sql(&format!(
        "INSERT INTO {{relays}} (relay_id, instance, host, pid, version, sink, in_flight,
                                started_at, last_seen)
         VALUES ('twin-relay', 'an-instance-elsewhere', 'elsewhere', 4242, '0.1.0', 'stdout', 0,
                 {now}, {now});"
    ));
    let s = db.status();
    let mut listed = registered(db, "twin-relay");
    listed.sort();
    assert_eq!(
        listed,
        vec![("elsewhere".to_owned(), 4242), (host(), pid)],
        "{s}"
    );
    assert_eq!(
        s["relay_id_conflicts"],
        serde_json::json!(["twin-relay"]),
        "{s}"
    );
    for r in s["relays"].as_array().unwrap() {
        assert_eq!(r["id_conflict"], true, "{s}");
        assert!(r["started_at"].is_string(), "{s}");
    }
    let text = run_ok(db.cmd().arg("status"));
    assert!(
        text.contains("RELAY ID CONFLICT: 2 relays run under twin-relay")
            && text.contains(&format!("pid {pid}  started "))
            && text.contains("elsewhere pid 4242  started "),
        "{text}"
    );

    sigterm(&relay);
    relay.wait_with_output().unwrap();
    assert_eq!(
        registered(db, "twin-relay"),
        vec![("elsewhere".to_owned(), 4242)],
        "a relay leaves only its own row"
    );
}

/// This host's name as the relay writes it.
fn host() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

#[test]
fn two_relays_under_one_id_are_each_listed_sqlite() {
    two_relays_under_one_id_are_each_listed(&Db::sqlite());
}

#[test]
fn two_relays_under_one_id_are_each_listed_postgres() {
    two_relays_under_one_id_are_each_listed(&Db::postgres());
}

#[test]
fn two_relays_under_one_id_are_each_listed_mariadb() {
    two_relays_under_one_id_are_each_listed(&Db::mariadb());
}

/// After a `kill -9` and a restart under the same id, `status` lists the new process
/// only, counts as its claims only the rows it claimed, and shows the dead process's
/// claims (still under their lease) as an earlier process's.
fn a_restarted_relay_is_not_given_the_dead_ones_claims(db: &Db) {
    run_ok(db.cmd().arg("migrate"));
    db.enqueue("phoenix.v1", 3);
    let (port, _hole) = black_hole();
    let start = || {
        db.cmd()
            .args([
                "relay",
                "--sink",
                &format!("http://127.0.0.1:{port}/hook"),
                "--relay-id",
                "phoenix-relay",
                "--lease-ms",
                "120000",
                "--publish-timeout-ms",
                "120000",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut dead = start();
    wait_for("the first relay's claims", Duration::from_secs(20), || {
        let s = db.status();
        (s["claimed"] == 3 && s["relays"].as_array()?.len() == 1).then_some(())
    });
    dead.kill().unwrap();
    dead.wait().unwrap();

    let mut live = start();
    let pid = i64::from(live.id());
    wait_for("the restart registered", Duration::from_secs(20), || {
        (registered(db, "phoenix-relay") == vec![(host(), pid)]).then_some(())
    });
    db.enqueue("phoenix.v1", 2);
    let s = wait_for("the restart's claims", Duration::from_secs(20), || {
        let s = db.status();
        (s["claimed"] == 5).then_some(s)
    });
    assert_eq!(registered(db, "phoenix-relay"), vec![(host(), pid)], "{s}");
    assert_eq!(s["relays"][0]["claimed"], 2, "its own claims only: {s}");
    assert_eq!(s["relays"][0]["id_conflict"], false, "{s}");
    let earlier = s["claims_of_earlier_processes"].as_array().unwrap();
    assert_eq!(earlier.len(), 1, "{s}");
    assert_eq!(earlier[0]["relay_id"], "phoenix-relay");
    assert_eq!(
        (
            earlier[0]["claimed"].as_i64(),
            earlier[0]["expired"].as_i64()
        ),
        (Some(3), Some(0)),
        "{s}"
    );
    let text = run_ok(db.cmd().arg("status"));
    assert!(
        text.contains(&format!("pid {pid}  started "))
            && text.contains("claims 2  ")
            && text.contains(
                "claimed by an earlier process of phoenix-relay: 3 rows, 0 with an ended lease"
            ),
        "{text}"
    );
    live.kill().unwrap();
    live.wait().unwrap();
}

#[test]
fn a_restarted_relay_is_not_given_the_dead_ones_claims_sqlite() {
    a_restarted_relay_is_not_given_the_dead_ones_claims(&Db::sqlite());
}

#[test]
fn a_restarted_relay_is_not_given_the_dead_ones_claims_postgres() {
    a_restarted_relay_is_not_given_the_dead_ones_claims(&Db::postgres());
}

#[test]
fn a_restarted_relay_is_not_given_the_dead_ones_claims_mariadb() {
    a_restarted_relay_is_not_given_the_dead_ones_claims(&Db::mariadb());
}
