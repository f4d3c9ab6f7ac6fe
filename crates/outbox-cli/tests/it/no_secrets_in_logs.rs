//! No payload and no password ever reaches the `outbox` binary's output: every sink this
//! machine runs (NATS JetStream, RabbitMQ, Redis, MQTT, HTTP, file) is driven by
//! `outbox relay --drain` at `OUTBOX_LOG=trace`, with a marker payload (and header) and a
//! marker password in the sink URL, through success, refusal, unroutable and unreachable
//! paths; neither marker may appear on stderr, nor on stdout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{free_port, wait_for};
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// In every payload and in a header.
const PAYLOAD: &str = "SECRET-PAYLOAD-7f3a";
/// In every sink URL that takes a password (a query secret elsewhere).
const PASS: &str = "SECRET-PASS-9c1e";
/// What must never show: any text starting like the markers.
const MARKERS: [&str; 2] = ["SECRET-PAYLOAD", "SECRET-PASS"];

/// `marker` as text and as the byte renderings a `Debug` of bytes produces (lapin prints
/// payloads as `[83, 69, …]`), in hex too.
fn renderings(marker: &str) -> Vec<String> {
    let bytes = marker.as_bytes();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    vec![
        marker.to_owned(),
        bytes
            .iter()
            .map(u8::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        hex.clone(),
        hex.to_uppercase(),
    ]
}

/// The log filter the relay runs with (`OUTBOX_LOG`); `NO_SECRETS_TEST_LOG` overrides it,
/// e.g. `trace,lapin=trace` to see this test catch what the default quiets.
fn test_log() -> String {
    std::env::var("NO_SECRETS_TEST_LOG").unwrap_or_else(|_| "trace".into())
}

fn outbox(db: &str) -> Command {
    let mut c = crate::common::outbox();
    c.env_remove("OUTBOX_ROUTE")
        .env("OUTBOX_DATABASE_URL", db)
        .env("OUTBOX_LOG", test_log());
    c
}

fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// Enqueues one message per topic (marker payload and header), runs the relay to `sink`
/// with `--drain`, and checks its output for the markers. Returns the final status.
fn relay_and_check(label: &str, sink: &str, topics: &[&str]) -> serde_json::Value {
    relay_and_check_with(label, sink, topics, false)
}

/// As [`relay_and_check`] for credentials the server refuses: the relay stops at start
/// (exit 1) saying so.
fn relay_refused_and_check(label: &str, sink: &str, topics: &[&str]) -> serde_json::Value {
    relay_and_check_with(label, sink, topics, true)
}

fn relay_and_check_with(
    label: &str,
    sink: &str,
    topics: &[&str],
    refused: bool,
) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let ok = |out: Output, what: &str| {
        assert!(
            out.status.success(),
            "{label}: {what} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    ok(outbox(&db).arg("migrate").output().unwrap(), "migrate");
    for topic in topics {
        let payload = format!("{{\"card\":\"{PAYLOAD}\",\"topic\":\"{topic}\"}}");
        ok(
            outbox(&db)
                .args(["enqueue", "--topic", topic, "--payload", &payload])
                .args(["--header", &format!("note={PAYLOAD}")])
                .output()
                .unwrap(),
            "enqueue",
        );
    }
    let start = Instant::now();
    let out = outbox(&db)
        .args(["relay", "--sink", sink, "--drain"])
        .args(["--max-attempts", "1", "--publish-timeout-ms", "4000"])
        .args(["--lease-ms", "20000", "--backoff-base-ms", "100"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if refused {
        assert!(
            out.status.code() == Some(1) && stderr.contains("refused the credentials"),
            "{label}: relay exited with {:?}, expected a refusal at start: {stderr}",
            out.status
        );
    } else {
        assert!(
            matches!(out.status.code(), Some(0 | 3 | 4)),
            "{label}: relay exited with {:?}: {stderr}",
            out.status
        );
    }
    for marker in MARKERS.iter().flat_map(|m| renderings(m)) {
        assert!(
            !stderr.contains(&marker),
            "{label}: {marker} on stderr:\n{stderr}"
        );
        assert!(
            !stdout.contains(&marker),
            "{label}: {marker} on stdout:\n{stdout}"
        );
    }
    let status = ok(
        outbox(&db).args(["status", "--json"]).output().unwrap(),
        "status",
    );
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    eprintln!(
        "{label}: {} stderr lines in {:?}, status {status}",
        stderr.lines().count(),
        start.elapsed()
    );
    status
}

fn count(status: &serde_json::Value, field: &str) -> i64 {
    status[field].as_i64().unwrap()
}

// ---------------------------------------------------------------------------------------
// NATS: a private server with a user and password, JetStream on.
// ---------------------------------------------------------------------------------------

struct PrivateNats {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn private_nats() -> PrivateNats {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let child = Command::new("/usr/sbin/nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(dir.path())
        .args(["--user", "relay", "--pass", PASS])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nats-server must be installed (/usr/sbin/nats-server)");
    wait_for("the private nats-server", Duration::from_secs(10), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).ok()
    });
    PrivateNats {
        child,
        port,
        _dir: dir,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_success_refusal_unroutable_and_unreachable() {
    let server = private_nats().await;
    let url = format!("nats://relay:{PASS}@127.0.0.1:{}", server.port);
    let client = async_nats::ConnectOptions::with_user_and_password("relay".into(), PASS.into())
        .connect(format!("127.0.0.1:{}", server.port))
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "OK".into(),
        subjects: vec!["ok.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "SMALL".into(),
        subjects: vec!["small.>".into()],
        max_message_size: 16,
        ..Default::default()
    })
    .await
    .unwrap();
    let status = relay_and_check("nats", &url, &["ok.a", "small.a", "nowhere.a"]);
    assert_eq!(
        (count(&status, "dispatched"), count(&status, "dead")),
        (1, 2)
    );

    // A wrong password (refused at start) and an unreachable server: the errors and the
    // start warning name the URL, redacted.
    let wrong = format!("nats://relay:{PASS}-wrong@127.0.0.1:{}", server.port);
    relay_refused_and_check("nats wrong password", &wrong, &["ok.b"]);
    let closed = format!("nats://relay:{PASS}@127.0.0.1:{}", free_port());
    let status = relay_and_check("nats unreachable", &closed, &["ok.c"]);
    assert_eq!(count(&status, "dead"), 0);
}

// ---------------------------------------------------------------------------------------
// RabbitMQ: a user with the marker password.
// ---------------------------------------------------------------------------------------

fn rabbitmqctl(args: &[&str]) -> Output {
    Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl must be installed (RabbitMQ on 127.0.0.1:5672)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_success_refusal_and_unroutable() {
    let user = "outbox_secret_test";
    if !rabbitmqctl(&["add_user", user, PASS]).status.success() {
        assert!(
            rabbitmqctl(&["change_password", user, PASS])
                .status
                .success()
        );
    }
    assert!(
        rabbitmqctl(&["set_permissions", "-p", "/", user, ".*", ".*", ".*"])
            .status
            .success()
    );
    let conn = lapin::Connection::connect(
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        lapin::ConnectionProperties::default(),
    )
    .await
    .expect("RabbitMQ must listen on 127.0.0.1:5672");
    let channel = conn.create_channel().await.unwrap();
    let id = unique();
    let ok_queue = format!("secret_ok_{id}");
    let full_queue = format!("secret_full_{id}");
    let options = QueueDeclareOptions {
        auto_delete: false,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(ok_queue.as_str().into(), options, FieldTable::default())
        .await
        .unwrap();
    let mut full = FieldTable::default();
    full.insert("x-max-length".into(), AMQPValue::LongInt(0));
    full.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    channel
        .queue_declare(full_queue.as_str().into(), options, full)
        .await
        .unwrap();
    let url = format!("amqp://{user}:{PASS}@127.0.0.1:5672/%2f");
    let unroutable = format!("secret_none_{id}");
    let status = relay_and_check("rabbitmq", &url, &[&ok_queue, &full_queue, &unroutable]);
    assert_eq!(
        (count(&status, "dispatched"), count(&status, "dead")),
        (1, 2)
    );
    // A wrong password.
    relay_refused_and_check(
        "rabbitmq wrong password",
        &format!("amqp://{user}:{PASS}-wrong@127.0.0.1:5672/%2f"),
        &[&ok_queue],
    );
    for q in [&ok_queue, &full_queue] {
        let _ = channel
            .queue_delete(q.as_str().into(), Default::default())
            .await;
    }
}

// ---------------------------------------------------------------------------------------
// Redis: an ACL user with the marker password.
// ---------------------------------------------------------------------------------------

fn redis_cli(args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", "6379"])
        .args(args)
        .output()
        .expect("redis-cli must be installed (Redis on 127.0.0.1:6379)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_success_and_refusal() {
    let user = "outbox_secret_test";
    let pass_rule = format!(">{PASS}");
    assert!(
        redis_cli(&[
            "ACL", "SETUSER", user, "reset", "on", &pass_rule, "~*", "&*", "+@all"
        ])
        .contains("OK")
    );
    let id = unique();
    let stream = format!("secret.ok.{id}");
    let not_a_stream = format!("secret.string.{id}");
    redis_cli(&["SET", &not_a_stream, "plain"]);
    let url = format!("redis://{user}:{PASS}@127.0.0.1:6379/0");
    let status = relay_and_check("redis", &url, &[&stream, &not_a_stream]);
    assert_eq!(
        (count(&status, "dispatched"), count(&status, "dead")),
        (1, 1)
    );
    relay_refused_and_check(
        "redis wrong password",
        &format!("redis://{user}:{PASS}-wrong@127.0.0.1:6379/0"),
        &[&stream],
    );
    redis_cli(&["DEL", &stream, &not_a_stream]);
}

// ---------------------------------------------------------------------------------------
// MQTT: Mosquitto takes any credentials here (anonymous allowed); they are still sent.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_success_and_unreachable() {
    let id = unique();
    let url = format!("mqtt://relay:{PASS}@127.0.0.1:1883?client_id=secret-{id}");
    let status = relay_and_check("mqtt", &url, &[&format!("secret/ok/{id}")]);
    assert_eq!(count(&status, "dispatched"), 1);
    let closed = format!(
        "mqtt://relay:{PASS}@127.0.0.1:{}?client_id=secret-{id}",
        free_port()
    );
    relay_and_check("mqtt unreachable", &closed, &["secret/x"]);
}

// ---------------------------------------------------------------------------------------
// HTTP: a tiny endpoint answering by path; the password in the userinfo and a token in
// the query.
// ---------------------------------------------------------------------------------------

/// Answers every request by its path: `/ok…` 200, `/busy` 503, `/echo` 400 with the
/// request's body echoed back, anything else 422.
fn http_endpoint() -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // Read the head and the body (Content-Length), then answer; keep-alive.
                loop {
                    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n");
                    if let Some(end) = head_end {
                        let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            let status = if head.starts_with("post /ok") {
                                "200 OK"
                            } else if head.starts_with("post /busy") {
                                "503 Service Unavailable\r\nRetry-After: 1"
                            } else if head.starts_with("post /echo") {
                                "400 Bad Request"
                            } else {
                                "422 Unprocessable Content"
                            };
                            // `/echo` answers with the request's body, as some endpoints
                            // quote what they refuse.
                            let body: Vec<u8> = if head.starts_with("post /echo") {
                                buf[end + 4..end + 4 + len].to_vec()
                            } else {
                                b"nope :(".to_vec()
                            };
                            let mut reply = format!(
                                "HTTP/1.1 {status}\r\nContent-Length: {}\r\n\r\n",
                                body.len()
                            )
                            .into_bytes();
                            reply.extend_from_slice(&body);
                            if stream.write_all(&reply).is_err() {
                                return;
                            }
                            buf.drain(..end + 4 + len);
                            continue;
                        }
                    }
                    match stream.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_success_refusal_pressure_and_unreachable() {
    let port = http_endpoint();
    for (path, dispatched, dead) in [("ok", 1, 0), ("refuse", 0, 1), ("busy", 0, 0)] {
        let url = format!("http://hook:{PASS}@127.0.0.1:{port}/{path}?token={PASS}");
        let status = relay_and_check(&format!("http {path}"), &url, &["hooks.a"]);
        assert_eq!(
            (count(&status, "dispatched"), count(&status, "dead")),
            (dispatched, dead),
            "{path}"
        );
    }
    let closed = format!(
        "http://hook:{PASS}@127.0.0.1:{}/ok?token={PASS}",
        free_port()
    );
    relay_and_check("http unreachable", &closed, &["hooks.a"]);
}

// ---------------------------------------------------------------------------------------
// File: the payload goes to the file only.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_sink_writes_the_payload_to_the_file_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.jsonl");
    let status = relay_and_check("file", &format!("file:{}", path.display()), &["a.b"]);
    assert_eq!(count(&status, "dispatched"), 1);
    assert!(std::fs::read_to_string(&path).unwrap().contains(PAYLOAD));
}

// ---------------------------------------------------------------------------------------
// Secrets outside the sink URL's password: a webhook's path, a refusal echoing the
// payload, configuration files and mistyped URLs, a database URL's parameters.
// ---------------------------------------------------------------------------------------

/// Fails when `text` (output of `what`) holds either marker in any rendering.
fn assert_clean(what: &str, text: &str) {
    for marker in MARKERS.iter().flat_map(|m| renderings(m)) {
        assert!(!text.contains(&marker), "{what}: {marker} in:\n{text}");
    }
}

/// A database of its own (SQLite, migrated) for one test.
fn sqlite_db() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let out = outbox(&db).arg("migrate").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (dir, db)
}

fn enqueue_marked(db: &str, topic: &str) -> serde_json::Value {
    let payload = format!("{{\"card\":\"{PAYLOAD}\"}}");
    let out = outbox(db)
        .args(["enqueue", "--topic", topic, "--payload", &payload])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// One `GET` to 127.0.0.1:`port`: (status, body).
fn http_get(port: u16, path: &str, token: Option<&str>) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n{auth}\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, text.split_once("\r\n\r\n")?.1.to_owned()))
}

/// Output of a command, both streams.
fn both(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A chat-style webhook whose secret is its path (`…/services/T000/B000/SECRET`): the
/// running relay's logs, `/metrics` (open), `/api/overview` (read-only token) with the
/// registry rows, `outbox status` and `status --json` show the destination as host and
/// a hash, never the path.
#[test]
fn a_webhook_secret_in_the_path_never_shows() {
    const READER: &str = "read-token-0123456789abcdef";
    let port = http_endpoint();
    let (_dir, db) = sqlite_db();
    enqueue_marked(&db, "hooks.a");
    let hook = format!("http://127.0.0.1:{port}/ok/services/T000/B000/{PASS}");
    let (admin, metrics) = (free_port(), free_port());
    let mut relay = outbox(&db)
        .args(["relay", "--route", &format!("hooks.>={hook}")])
        .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .env("OUTBOX_ADMIN_READ_TOKEN", READER)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let overview = wait_for("the delivery", Duration::from_secs(20), || {
        http_get(admin, "/api/overview", Some(READER))
            .and_then(|(code, body)| (code == 200).then_some(body))
            .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
            .filter(|o| {
                o["dispatched"] == 1 && o["relays"].as_array().is_some_and(|r| r.len() == 1)
            })
    });
    let shown = overview["relays"][0]["sink"].as_str().unwrap().to_owned();
    assert!(
        shown.contains(&format!("hooks.>=webhook http://127.0.0.1:{port}/…#")),
        "{overview}"
    );
    let (code, scrape) = http_get(metrics, "/metrics", None).unwrap();
    assert_eq!(code, 200);
    assert!(scrape.contains(&format!("127.0.0.1:{port}/…#")), "{scrape}");
    let status = outbox(&db).arg("status").output().unwrap();
    let status_json = outbox(&db).args(["status", "--json"]).output().unwrap();
    let _ = relay.kill();
    let out = relay.wait_with_output().unwrap();
    for (what, text) in [
        ("/api/overview", overview.to_string()),
        ("/metrics", scrape),
        ("status", both(&status)),
        ("status --json", both(&status_json)),
        ("relay", both(&out)),
    ] {
        assert_clean(what, &text);
    }
    assert!(both(&status).contains("/…#"), "{}", both(&status));
}

/// An endpoint that refuses with `400` and quotes the request (the payload) in its body:
/// the body reaches neither the logs nor `last_error` (`dead list`, `dead show`).
#[test]
fn a_refusal_echoing_the_payload_never_shows() {
    let port = http_endpoint();
    let (_dir, db) = sqlite_db();
    let row = enqueue_marked(&db, "hooks.echo");
    let out = outbox(&db)
        .args(["relay", "--drain", "--max-attempts", "1"])
        .args(["--sink", &format!("http://127.0.0.1:{port}/echo")])
        .output()
        .unwrap();
    assert!(
        matches!(out.status.code(), Some(0 | 3 | 4)),
        "{}",
        both(&out)
    );
    assert_clean("relay", &both(&out));
    let id = row["id"].to_string();
    let list = outbox(&db)
        .args(["dead", "list", "--json"])
        .output()
        .unwrap();
    let text = both(&list);
    assert!(text.contains("400 Bad Request"), "{text}");
    assert_clean("dead list --json", &text);
    for args in [
        vec!["dead", "list"],
        vec!["dead", "show", &id],
        vec!["dead", "show", &id, "--json"],
    ] {
        let out = outbox(&db).args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", both(&out));
        assert_clean(&format!("{args:?}"), &both(&out));
    }
}

/// A malformed `outbox.toml` whose bad line holds a password, and a tokens file with its
/// fields in the wrong order: the errors name the line, never its text.
#[test]
fn config_and_tokens_file_errors_never_show_their_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("outbox.toml");
    for text in [
        format!("schema = \"app\"\npassword = \"hunter2{PASS}\" and more\n"),
        format!("database-url = \"postgres://app:{PASS}@db/shop\n"),
        format!("database-url = \"postgres://app@db/shop\"\npassword = [\"{PASS}\", 1]\n"),
        format!("database-url = {{ password = \"{PASS}\" }}\n"),
    ] {
        std::fs::write(&config, &text).unwrap();
        let out = crate::common::outbox()
            .args(["--config", config.to_str().unwrap(), "status"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{text}");
        let shown = both(&out);
        assert!(shown.contains("outbox.toml"), "{shown}");
        assert_clean(&format!("config {text:?}"), &shown);
    }
    let tokens = dir.path().join("tokens");
    for line in [
        format!("alice:{PASS}-0123456789:read"),
        format!("read:alice:{PASS}-0123456789"),
        format!("{PASS}-0123456789:alice"),
        format!("alice:operator:{PASS}-0123456789\nbob:root:{PASS}-0123456789xyz"),
    ] {
        std::fs::write(&tokens, &line).unwrap();
        let out = crate::common::outbox()
            .env("OUTBOX_DATABASE_URL", "sqlite::memory:")
            .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port())])
            .arg("--admin-tokens-file")
            .arg(&tokens)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{line}");
        let shown = both(&out);
        assert!(shown.contains("line "), "{shown}");
        assert_clean(&format!("tokens file {line:?}"), &shown);
    }
}

/// Sink URLs and routes that cannot be used: a NATS token under a mistyped scheme, a route
/// without its pattern, a mistyped NATS query parameter with a secret value, a Kafka OAuth
/// configuration. Refused, and the secret is not in the refusal.
#[test]
fn refused_sink_urls_never_show_their_secrets() {
    let (_dir, db) = sqlite_db();
    let cases: Vec<Vec<String>> = vec![
        vec!["--sink".into(), format!("nats+tls:/{PASS}@127.0.0.1:4222")],
        vec!["--sink".into(), format!("nat://user:{PASS}@127.0.0.1:4222")],
        vec!["--sink".into(), format!("nat://{PASS}@127.0.0.1:4222")],
        vec!["--route".into(), format!("nats://{PASS}@127.0.0.1:4222")],
        vec![
            "--route".into(),
            format!("nats://{PASS}@127.0.0.1:4222?x=1"),
        ],
        vec![
            "--sink".into(),
            format!("nats://127.0.0.1:4222?tokne={PASS}"),
        ],
        vec![
            "--sink".into(),
            format!("nats://127.0.0.1:4222?ca=/x&tokne={PASS}"),
        ],
        vec![
            "--sink".into(),
            format!("kafka://127.0.0.1:9092?kafka.sasl.oauthbearer.config=principal={PASS}"),
        ],
        vec![
            "--route".into(),
            format!("a.>=kafka://127.0.0.1:9092?kafka.sasl.oauthbearer.config={PASS}"),
        ],
    ];
    for args in cases {
        let out = outbox(&db)
            .arg("relay")
            .args(&args)
            .arg("--drain")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        assert_clean(&format!("{args:?}"), &both(&out));
    }
}

/// `sslpassword=` in a PostgreSQL URL (a client key's passphrase): the driver's notice
/// about the parameter would name its value; at the default log level nothing does.
#[test]
fn a_database_url_parameter_never_shows_at_the_default_level() {
    let url = format!("{}?sslpassword={PASS}", crate::common::PG);
    let out = crate::common::outbox()
        .env_remove("OUTBOX_LOG")
        .env("OUTBOX_DATABASE_URL", &url)
        .arg("status")
        .output()
        .unwrap();
    assert_clean("status", &both(&out));
}

/// `--help` lists each option's environment variable but never its value: URLs, routes
/// and tokens taken from the environment stay out of the help text.
#[test]
fn help_never_shows_the_environment_values() {
    let out = crate::common::outbox()
        .args(["relay", "--help"])
        .env("OUTBOX_DATABASE_URL", format!("postgres://u:{PASS}1@h/db"))
        .env("OUTBOX_SINK", format!("nats://u:{PASS}2@h"))
        .env("OUTBOX_ROUTE", format!("a=nats://u:{PASS}3@h"))
        .env("OUTBOX_OTLP_ENDPOINT", format!("http://u:{PASS}4@h"))
        .env("OUTBOX_ADMIN_TOKEN", format!("{PASS}5-0123456789abcdef"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", both(&out));
    let text = both(&out);
    assert!(text.contains("OUTBOX_SINK"), "{text}");
    assert_clean("relay --help", &text);
}

/// A URL given where clap expects none (a misplaced or mistyped argument) is quoted in
/// the usage error redacted; the exit code stays 2.
#[test]
fn a_usage_error_redacts_the_urls_it_quotes() {
    for args in [
        vec!["relay".to_owned(), format!("nats://u:{PASS}@h")],
        vec!["relay".to_owned(), format!("--snk=nats://u:{PASS}@h")],
        vec![
            "relay".to_owned(),
            "--batch-size".to_owned(),
            format!("https://hooks.example/services/T0/B0/{PASS}"),
        ],
    ] {
        let out = crate::common::outbox()
            .args(&args)
            .env_remove("OUTBOX_ROUTE")
            .output()
            .unwrap();
        let text = both(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains("error:"), "{args:?}: {text}");
        assert_clean(&format!("{args:?}"), &text);
    }
}
