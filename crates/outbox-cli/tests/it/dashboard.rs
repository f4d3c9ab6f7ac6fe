//! The admin server end to end: `outbox serve` against real stores (SQLite, PostgreSQL,
//! MariaDB) with dead, pending and dispatched rows made by the CLI; every API route with
//! an operator token, a read-only token and none (401/403), bad input refused, changes
//! audited under the token's name; an open server refused off loopback; the admin server
//! inside a relay (`--admin-addr`) beside `--metrics-addr`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{MYSQL, PG, free_port, outbox, run, run_ok, run_quarantining, unique};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub(crate) const OPERATOR: &str = "op-token-0123456789abcdef";
pub(crate) const DANA: &str = "dana-token-0123456789abcdef";
pub(crate) const READER: &str = "read-token-0123456789abcdef";

pub(crate) struct Db {
    url: String,
    schema: String,
    pub(crate) dir: tempfile::TempDir,
}

impl Db {
    pub(crate) fn new(url: Option<&str>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = match url {
            Some(u) => u.to_owned(),
            None => format!("sqlite://{}", dir.path().join("dash.db").display()),
        };
        Db {
            url,
            schema: unique("dash"),
            dir,
        }
    }

    pub(crate) fn cmd(&self) -> Command {
        let mut c = outbox();
        c.args(["--database-url", &self.url, "--schema", &self.schema])
            .env_remove("OUTBOX_ADMIN_TOKEN")
            .env_remove("OUTBOX_ADMIN_READ_TOKEN")
            .env_remove("OUTBOX_ADMIN_TOKENS_FILE");
        c
    }

    pub(crate) fn enqueue(&self, topic: &str, key: Option<&str>, payload: &str) -> Value {
        let mut c = self.cmd();
        c.args(["enqueue", "--topic", topic, "--payload", payload]);
        if let Some(k) = key {
            c.args(["--key", k]);
        }
        serde_json::from_str(run_ok(&mut c).trim()).unwrap()
    }
}

/// A running `outbox serve`, killed when dropped.
pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn serve(db: &Db) -> Server {
    let tokens = db.dir.path().join("tokens");
    std::fs::write(
        &tokens,
        format!("# people\ndana:operator:{DANA}\nauditor:read:{READER}\n"),
    )
    .unwrap();
    let port = free_port();
    let child = db
        .cmd()
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env("OUTBOX_ADMIN_TOKEN", OPERATOR)
        .env("OUTBOX_ADMIN_TOKENS_FILE", &tokens)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server { child, port };
    wait_for("the admin server", || {
        request(port, "GET", "/healthz", None, None, &[]).filter(|r| r.0 == 200)
    });
    server
}

/// One HTTP/1.1 request to 127.0.0.1:`port`: (status, body).
pub(crate) fn request(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    extra: &[(&str, &str)],
) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.unwrap_or("");
    if method == "POST" {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body.as_bytes()).ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, text.split_once("\r\n\r\n")?.1.to_owned()))
}

pub(crate) fn wait_for<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    crate::common::wait_for(what, Duration::from_secs(20), f)
}

pub(crate) struct Api {
    pub(crate) port: u16,
}

impl Api {
    pub(crate) fn get(&self, path: &str, token: Option<&str>) -> (u16, Value) {
        let (code, body) = request(self.port, "GET", path, token, None, &[]).unwrap();
        (
            code,
            serde_json::from_str(&body).unwrap_or(Value::String(body)),
        )
    }

    pub(crate) fn post(&self, path: &str, token: Option<&str>, body: &Value) -> (u16, Value) {
        self.post_raw(path, token, &body.to_string(), &[])
    }

    fn post_raw(
        &self,
        path: &str,
        token: Option<&str>,
        body: &str,
        extra: &[(&str, &str)],
    ) -> (u16, Value) {
        let (code, body) = request(self.port, "POST", path, token, Some(body), extra).unwrap();
        (
            code,
            serde_json::from_str(&body).unwrap_or(Value::String(body)),
        )
    }

    /// GET that must answer 200.
    pub(crate) fn ok(&self, path: &str, token: &str) -> Value {
        let (code, v) = self.get(path, Some(token));
        assert_eq!(code, 200, "GET {path}: {v}");
        v
    }
}

pub(crate) fn error_of(v: &Value) -> &str {
    v["error"].as_str().unwrap_or_default()
}

/// Three dead letters (no route for their topic), two dispatched to a file, one pending:
/// every route of the API, its refusals, and the audit naming the token.
fn api_round_trip(db: &Db) {
    run_ok(db.cmd().arg("migrate"));
    let dead: Vec<Value> = (0..3)
        .map(|i| db.enqueue("dash.orders.v1", Some("cust-1"), &format!("{{\"n\":{i}}}")))
        .collect();
    db.enqueue("ok.ping.v1", None, "a");
    db.enqueue("ok.ping.v1", None, "b");
    let out = db.dir.path().join("out.jsonl");
    run_quarantining(db.cmd().args([
        "relay",
        "--drain",
        "--route",
        &format!("ok.>=file:{}", out.display()),
    ]));
    let pending = db.enqueue("ok.ping.v1", Some("k-9"), "later");
    let server = serve(db);
    let api = Api { port: server.port };

    // The page and the probes are public; everything else needs a token.
    let (code, page) = request(api.port, "GET", "/", None, None, &[]).unwrap();
    assert_eq!(code, 200);
    assert!(page.contains("<title>outbox dashboard</title>"), "{page}");
    assert_eq!(api.get("/readyz", None).0, 200);
    let (code, v) = api.get("/api/overview", None);
    assert_eq!(code, 401, "{v}");
    assert!(error_of(&v).contains("Authorization: Bearer"), "{v}");
    let (code, v) = api.get("/api/overview", Some("not-a-token-at-all-xx"));
    assert_eq!((code, error_of(&v)), (401, "the token is not valid"));
    assert_eq!(api.get("/metrics", None).0, 401);
    let (code, metrics) = request(api.port, "GET", "/metrics", Some(READER), None, &[]).unwrap();
    assert_eq!(code, 200, "{metrics}");

    let me = api.ok("/api/me", READER);
    assert_eq!(me, json!({"name": "auditor", "role": "read"}));
    assert_eq!(api.ok("/api/me", OPERATOR)["name"], "admin");

    // The overview: counts, verdict, the hour's throughput.
    let o = api.ok("/api/overview", READER);
    assert_eq!(
        (&o["pending"], &o["dispatched"], &o["dead"]),
        (&json!(1), &json!(2), &json!(3)),
        "{o}"
    );
    assert_eq!(o["verdict"]["state"], "DEAD", "{o}");
    let hour = o["throughput"].as_array().unwrap();
    assert_eq!(hour.len(), 60);
    let sum = |k: &str| hour.iter().map(|m| m[k].as_i64().unwrap()).sum::<i64>();
    assert_eq!((sum("dispatched"), sum("dead")), (2, 3), "{o}");
    assert_eq!(o["dead_by_topic"], json!([["dash.orders.v1", 3]]));

    // Dead letters: filters and pages.
    let all = api.ok("/api/dead?topic=dash.%3E", READER);
    assert_eq!(all["total"], 3);
    let rows = all["rows"].as_array().unwrap();
    let ids: Vec<i64> = rows.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(
        ids,
        dead.iter()
            .map(|d| d["id"].as_i64().unwrap())
            .collect::<Vec<_>>()
    );
    assert!(rows[0]["last_error"].as_str().unwrap().contains("no route"));
    let page1 = api.ok("/api/dead?limit=2", READER);
    assert_eq!(page1["rows"].as_array().unwrap().len(), 2);
    assert_eq!(page1["next_after"], ids[1]);
    let page2 = api.ok(&format!("/api/dead?limit=2&after={}", ids[1]), READER);
    assert_eq!(page2["rows"][0]["id"], ids[2]);
    assert_eq!(page2["next_after"], Value::Null);
    assert_eq!(page2["total"], 3, "the total ignores the page");
    assert_eq!(
        api.ok("/api/dead?error=NO%20ROUTE", READER)["total"],
        3,
        "error text is case-insensitive"
    );
    assert_eq!(api.ok("/api/dead?error=timeout", READER)["total"], 0);
    assert_eq!(api.ok("/api/dead?since=1h", READER)["total"], 3);
    let (code, v) = api.get("/api/dead?since=yesterday-ish", Some(READER));
    assert_eq!(code, 400);
    assert!(error_of(&v).contains("neither a duration"), "{v}");
    let (code, v) = api.get("/api/dead?topic=a..b", Some(READER));
    assert_eq!(code, 400, "{v}");
    let (code, v) = api.get("/api/dead?limit=many", Some(READER));
    assert_eq!(code, 400, "{v}");
    assert!(
        error_of(&v).contains("limit"),
        "a JSON error naming the field: {v}"
    );
    let (code, v) = api.get("/api/dead?colour=red", Some(READER));
    assert_eq!(code, 400, "unknown parameters are refused: {v}");

    // One dead letter; its payload only for operators.
    let one = api.ok(&format!("/api/dead/{}", ids[0]), READER);
    assert_eq!(one["topic"], "dash.orders.v1");
    assert_eq!(one["key"], "cust-1");
    assert_eq!(one["blocking"], false);
    assert!(
        one.get("payload_text").is_none(),
        "hidden by default: {one}"
    );
    let by_message_id = api.ok(
        &format!("/api/dead/{}", dead[0]["message_id"].as_str().unwrap()),
        READER,
    );
    assert_eq!(by_message_id["id"], ids[0]);
    let (code, v) = api.get(&format!("/api/dead/{}?payload=true", ids[0]), Some(READER));
    assert_eq!(code, 403, "{v}");
    let with = api.ok(&format!("/api/dead/{}?payload=true", ids[0]), DANA);
    assert_eq!(with["payload_text"], "{\"n\":0}");
    let (code, v) = api.get("/api/dead/999999999", Some(READER));
    assert_eq!(code, 404, "{v}");
    let (code, _) = api.get(
        &format!("/api/dead/{}", pending["id"].as_i64().unwrap()),
        Some(READER),
    );
    assert_eq!(code, 404, "a pending row is not a dead letter");
    assert_eq!(api.get("/api/dead/not-an-id", Some(READER)).0, 400);

    // Changes: refusals first, nothing changed.
    let replay = |token, body: Value| api.post("/api/dead/replay", Some(token), &body);
    let (code, v) = replay(READER, json!({"ids": [ids[0]], "reason": "r"}));
    assert_eq!(code, 403, "{v}");
    assert!(error_of(&v).contains("read-only"), "{v}");
    let (code, v) = api.post(
        "/api/dead/replay",
        None,
        &json!({"ids": [ids[0]], "reason": "r"}),
    );
    assert_eq!(code, 401, "{v}");
    let (code, v) = replay(DANA, json!({"ids": [ids[0]]}));
    assert_eq!(code, 400);
    assert!(error_of(&v).contains("reason must not be empty"), "{v}");
    let (code, v) = replay(DANA, json!({"reason": "everything"}));
    assert_eq!(code, 400);
    assert!(error_of(&v).contains("select the dead rows"), "{v}");
    let (code, v) = replay(
        DANA,
        json!({"ids": [ids[0], pending["id"], 999999999], "reason": "r"}),
    );
    assert_eq!(code, 422, "{v}");
    assert!(error_of(&v).contains("pending, not dead"), "{v}");
    assert!(error_of(&v).contains("999999999: unknown id"), "{v}");
    let (code, v) = replay(DANA, json!({"ids": [ids[0]], "reason": "r", "colour": 1}));
    assert_eq!(code, 400, "unknown fields are refused: {v}");
    let (code, v) = api.post_raw("/api/dead/replay", Some(DANA), "{not json", &[]);
    assert_eq!(code, 400, "{v}");
    let (code, v) = api.post_raw(
        "/api/dead/replay",
        Some(DANA),
        &json!({"ids": [ids[0]], "reason": "r"}).to_string(),
        &[("Origin", "http://evil.example")],
    );
    assert_eq!(code, 403, "{v}");
    assert!(error_of(&v).contains("cross-origin"), "{v}");
    assert_eq!(
        api.ok("/api/overview", READER)["dead"],
        3,
        "nothing changed"
    );

    // A dry run counts; the replay changes and is audited as dana.
    let (code, v) = replay(
        DANA,
        json!({"ids": [ids[0].to_string()], "reason": "route fixed", "dry_run": true}),
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!((&v["count"], &v["replay_id"]), (&json!(1), &Value::Null));
    assert_eq!(api.ok("/api/overview", READER)["dead"], 3);
    let (code, v) = replay(DANA, json!({"ids": [ids[0]], "reason": "route fixed"}));
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["count"], 1);
    let audit_id = v["replay_id"].as_i64().unwrap();
    let audit = api.ok("/api/replays", READER);
    let last = &audit["rows"][0];
    assert_eq!(last["id"], audit_id);
    assert_eq!(
        (&last["by"], &last["reason"], &last["action"]),
        (&json!("dana"), &json!("route fixed"), &json!("replay"))
    );
    let found = api.ok(
        &format!(
            "/api/messages?q={}",
            dead[0]["message_id"].as_str().unwrap()
        ),
        READER,
    );
    assert_eq!(found["by"], "message_id");
    assert_eq!(found["rows"][0]["status"], "pending", "{found}");
    assert_eq!(found["rows"][0]["replay_id"], audit_id);

    // Discard by filter, as the operator of OUTBOX_ADMIN_TOKEN.
    let (code, v) = api.post(
        "/api/dead/discard",
        Some(OPERATOR),
        &json!({"topic": "dash.>", "reason": "obsolete", "rate": 5}),
    );
    assert_eq!(code, 400, "a rate is for replays: {v}");
    let (code, v) = api.post(
        "/api/dead/discard",
        Some(OPERATOR),
        &json!({"topic": "dash.>", "error": "no route", "reason": "obsolete"}),
    );
    assert_eq!((code, &v["count"]), (200, &json!(2)), "{v}");
    let audit = api.ok("/api/replays?limit=1", READER);
    assert_eq!(audit["rows"].as_array().unwrap().len(), 1);
    assert_eq!(
        (&audit["rows"][0]["by"], &audit["rows"][0]["action"]),
        (&json!("admin"), &json!("discard"))
    );
    assert_eq!(api.ok("/api/overview", READER)["dead"], 0);

    // Pauses.
    let (code, _) = api.post(
        "/api/pause",
        Some(READER),
        &json!({"topic": "ok.>", "reason": "x"}),
    );
    assert_eq!(code, 403);
    let (code, v) = api.post("/api/pause", Some(DANA), &json!({"topic": "ok.>"}));
    assert_eq!(code, 400, "{v}");
    // A pattern of 33 tokens is refused with its reason, and pauses nothing.
    let (code, v) = api.post(
        "/api/pause",
        Some(DANA),
        &json!({"topic": vec!["t"; 33].join("."), "reason": "x"}),
    );
    assert_eq!(code, 400, "{v}");
    assert!(error_of(&v).contains("33 tokens, more than 32"), "{v}");
    let (code, v) = api.post(
        "/api/pause",
        Some(DANA),
        &json!({"topic": "ok.>", "reason": "deploy"}),
    );
    assert_eq!(code, 200, "{v}");
    let o = api.ok("/api/overview", READER);
    assert_eq!(o["topic_pauses"][0]["pattern"], "ok.>");
    assert_eq!(o["topic_pauses"][0]["by"], "dana");
    let (code, v) = api.post("/api/pause", Some(DANA), &json!({"reason": "all stop"}));
    assert_eq!(code, 200, "{v}");
    let o = api.ok("/api/overview", READER);
    assert_eq!(o["paused"], true);
    assert_eq!(o["verdict"]["state"], "PAUSED", "{o}");
    let (code, v) = api.post("/api/resume", Some(DANA), &json!({"topic": "nope.>"}));
    assert_eq!(code, 404, "{v}");
    assert!(error_of(&v).contains("paused: ok.>"), "{v}");
    assert_eq!(api.post("/api/resume", Some(DANA), &json!({})).0, 200);
    let (code, v) = api.post(
        "/api/resume",
        Some(DANA),
        &json!({"topic": "ok.>", "reason": "deployed"}),
    );
    assert_eq!(code, 200, "{v}");
    let o = api.ok("/api/overview", READER);
    assert_eq!(
        (&o["paused"], &o["topic_pauses"]),
        (&json!(false), &json!([]))
    );
    // Every pause and resume is in the audit, with the token's name.
    let audit = api.ok("/api/replays?limit=4", READER);
    let rows: Vec<(String, String, String, String)> = audit["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let f = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
            (f("action"), f("by"), f("selection"), f("reason"))
        })
        .collect();
    let row = |a: &str, sel: &str, why: &str| {
        (
            a.to_owned(),
            "dana".to_owned(),
            sel.to_owned(),
            why.to_owned(),
        )
    };
    assert_eq!(
        rows,
        vec![
            row("resume", "topics ok.>", "deployed"),
            row("resume", "all topics", ""),
            row("pause", "all topics", "all stop"),
            row("pause", "topics ok.>", "deploy"),
        ],
        "newest first: {audit}"
    );

    // Messages by key, within a topic.
    let by_key = api.ok("/api/messages?q=k-9&topic=ok.ping.v1", READER);
    assert_eq!(by_key["by"], "key");
    assert_eq!(by_key["rows"].as_array().unwrap().len(), 1);
    assert_eq!(by_key["rows"][0]["id"], pending["id"]);
    assert_eq!(
        api.ok("/api/messages?q=cust-1", READER)["rows"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "the two discarded rows are gone; the replayed one is pending"
    );
    assert_eq!(api.get("/api/messages?q=", Some(READER)).0, 400);
    assert_eq!(api.get("/api/nothing-here", Some(READER)).0, 404);
}

#[test]
fn dashboard_api_on_sqlite() {
    api_round_trip(&Db::new(None));
}

#[test]
fn dashboard_api_on_postgres() {
    api_round_trip(&Db::new(Some(PG)));
}

#[test]
fn dashboard_api_on_mariadb() {
    api_round_trip(&Db::new(Some(MYSQL)));
}

/// Without a token the server listens on loopback only (and says so); a short token or a
/// malformed tokens file stops it before it listens.
#[test]
fn dashboard_without_a_token_stays_on_loopback() {
    let db = Db::new(None);
    run_ok(db.cmd().arg("migrate"));
    let exposed = run(db
        .cmd()
        .args(["serve", "--listen", &format!("0.0.0.0:{}", free_port())]));
    assert!(!exposed.status.success());
    let err = String::from_utf8_lossy(&exposed.stderr);
    assert!(
        err.contains(
            "refusing to serve the admin API on an address other than loopback without a token"
        ),
        "{err}"
    );
    let short = run(db
        .cmd()
        .args(["serve", "--listen", "0.0.0.0:0"])
        .env("OUTBOX_ADMIN_TOKEN", "short"));
    assert!(
        String::from_utf8_lossy(&short.stderr).contains("shorter than 16 characters"),
        "{}",
        String::from_utf8_lossy(&short.stderr)
    );
    let bad_file = db.dir.path().join("tokens");
    std::fs::write(&bad_file, "dana:root:0123456789abcdef0123\n").unwrap();
    let bad = run(db
        .cmd()
        .args(["serve", "--admin-tokens-file"])
        .arg(&bad_file));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("line 1: the role (second field)"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );

    // On loopback without a token: served, everyone is the operator "local".
    let port = free_port();
    let mut server = Server {
        port,
        child: db
            .cmd()
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .env("OUTBOX_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    };
    let api = Api { port };
    let me = wait_for("the open server", || {
        let (code, v) = request(port, "GET", "/api/me", None, None, &[])?;
        (code == 200).then(|| serde_json::from_str::<Value>(&v).unwrap())
    });
    assert_eq!(me, json!({"name": "local", "role": "operator"}));
    assert_eq!(api.get("/api/overview", None).0, 200);
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let mut err = String::new();
    server
        .child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(err.contains("no admin token configured"), "{err}");
}

/// `relay --admin-addr` serves the API inside the relay, with this relay's destinations
/// and their state (live, and in its registry row), beside `--metrics-addr` (one recorder
/// for both).
#[test]
fn dashboard_inside_the_relay() {
    let db = Db::new(None);
    run_ok(db.cmd().arg("migrate"));
    db.enqueue("in.relay.v1", None, "x");
    let out = db.dir.path().join("out.jsonl");
    let (admin, metrics) = (free_port(), free_port());
    // Killed when dropped, a failed assertion included.
    let _relay = Server {
        port: admin,
        child: db
            .cmd()
            .args([
                "relay",
                "--sink",
                &format!("file:{}", out.display()),
                "--admin-addr",
                &format!("127.0.0.1:{admin}"),
                "--metrics-addr",
                &format!("127.0.0.1:{metrics}"),
            ])
            .env("OUTBOX_ADMIN_READ_TOKEN", READER)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    };
    let api = Api { port: admin };
    let o = wait_for("the relay's registry row and its delivery", || {
        let (code, o) = request(admin, "GET", "/api/overview", Some(READER), None, &[])?;
        let o: Value = serde_json::from_str(&o).ok()?;
        (code == 200 && o["relays"].as_array()?.len() == 1 && o["dispatched"] == 1).then_some(o)
    });
    let dests = o["destinations"].as_array().unwrap();
    assert_eq!(dests.len(), 1, "{o}");
    assert_eq!(dests[0]["state"], "up", "{o}");
    assert!(dests[0]["name"].as_str().unwrap().contains("file"), "{o}");
    assert_eq!(o["relays"][0]["sink"], format!("file:{}", out.display()));
    // The registry row carries them too, for a server outside any relay (`outbox serve`).
    assert_eq!(
        o["relays"][0]["destinations"],
        json!([{"name": format!("file:{}", out.display()), "state": "up"}]),
        "{o}"
    );
    assert_eq!(api.get("/readyz", None).0, 200);
    let (code, scrape) = request(admin, "GET", "/metrics", Some(READER), None, &[]).unwrap();
    assert_eq!(code, 200);
    assert!(scrape.contains("outbox_"), "{scrape}");
    let (code, plain) = request(metrics, "GET", "/metrics", None, None, &[]).unwrap();
    assert_eq!(code, 200, "--metrics-addr stays open: {plain}");
    let (code, _) = api.post("/api/pause", Some(READER), &json!({"reason": "x"}));
    assert_eq!(code, 403);
}

/// A payload that is not UTF-8 is shown as hex, and only when asked for by an operator.
#[test]
fn dashboard_shows_binary_payloads_as_hex() {
    let db = Db::new(None);
    run_ok(db.cmd().arg("migrate"));
    let mut enqueue = db
        .cmd()
        .args(["enqueue", "--topic", "bin.blob.v1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    enqueue
        .stdin
        .take()
        .unwrap()
        .write_all(&[0xff, 0x00, 0x01, 0xfe])
        .unwrap();
    let out = enqueue.wait_with_output().unwrap();
    assert!(out.status.success());
    let row: Value = serde_json::from_slice(&out.stdout).unwrap();
    let file = db.dir.path().join("out.jsonl");
    run_quarantining(db.cmd().args([
        "relay",
        "--drain",
        "--route",
        &format!("ok.>=file:{}", file.display()),
    ]));
    let server = serve(&db);
    let api = Api { port: server.port };
    let path = format!("/api/dead/{}", row["id"]);
    let plain = api.ok(&path, DANA);
    assert_eq!(plain["payload_bytes"], 4);
    assert!(plain.get("payload_hex").is_none() && plain.get("payload_text").is_none());
    let shown = api.ok(&format!("{path}?payload=true"), DANA);
    assert_eq!(shown["payload_hex"], "ff 00 01 fe", "{shown}");
    assert!(shown.get("payload_text").is_none());
}
