//! The HTTP listeners (`--metrics-addr`, `--admin-addr`, `outbox serve`) under abuse and
//! their smaller limits: connections that send half a request and hold are closed after
//! the header-read timeout while `/healthz` answers and the relay in the same process
//! keeps delivering; an oversized body is 413; API answers are not cached; a `since` out
//! of range is a 400 that says so; guessable tokens are refused at start; a large payload
//! is shown as a bounded preview and downloaded whole.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{PG, free_port, run_ok, run_quarantining};
use crate::dashboard::{Api, DANA, Db, READER, Server, error_of, request, serve, wait_for};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Connections held on each listener: more than the per-listener connection limit, and
/// together more than the file descriptors the relay starts with (below).
const HELD: usize = 300;

/// Opens `n` connections to `port` that each send half a request line and hold.
fn hold(port: u16, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"GET /healthz HTT").unwrap();
            s
        })
        .collect()
}

/// How many of `held` the server has not closed by `deadline` (a closed connection reads
/// an end of file, an error, or at most an error response before it).
fn still_open(held: &mut [TcpStream], deadline: Instant) -> usize {
    let mut open = 0;
    for s in held {
        let mut buf = [0u8; 512];
        loop {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            s.set_read_timeout(Some(left)).unwrap();
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    open += 1;
                    break;
                }
                Err(_) => break,
            }
        }
    }
    open
}

/// A relay with `--metrics-addr` and `--admin-addr`, started with a soft limit of 512
/// file descriptors and a header-read timeout of 1 s: 300 half-sent requests held on each
/// listener neither stop its delivery nor `/healthz`, and the server closes them.
#[test]
fn held_half_requests_do_not_starve_the_relay() {
    held_half_requests(
        "ulimit -Sn 512",
        "a soft limit below what they need (the hard one stays)",
    );
}

/// As above with a hard limit of 512 descriptors too, which the relay cannot raise: the
/// listeners' connection limits keep half of them for the relay.
#[test]
fn held_half_requests_do_not_starve_a_relay_with_few_descriptors() {
    held_half_requests("ulimit -n 512", "a hard limit below what they need");
}

fn held_half_requests(ulimit: &str, what: &str) {
    let db = Db::new(None);
    run_ok(db.cmd().arg("migrate"));
    let out = db.dir.path().join("out.jsonl");
    let (admin, metrics) = (free_port(), free_port());
    let relay = db.cmd();
    let mut shell = std::process::Command::new("sh");
    shell
        .arg("-c")
        .arg(format!("{ulimit} && exec \"$0\" \"$@\""))
        .arg(relay.get_program())
        .args(relay.get_args())
        .args([
            "relay",
            "--sink",
            &format!("file:{}", out.display()),
            "--poll-interval-ms",
            "50",
            "--admin-addr",
            &format!("127.0.0.1:{admin}"),
            "--metrics-addr",
            &format!("127.0.0.1:{metrics}"),
        ])
        .envs(
            relay
                .get_envs()
                .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))),
        )
        .env_remove("OUTBOX_ADMIN_TOKEN")
        .env_remove("OUTBOX_ADMIN_TOKENS_FILE")
        .env("OUTBOX_ADMIN_READ_TOKEN", READER)
        .env("OUTBOX_HTTP_HEADER_TIMEOUT", "1s")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _relay = Server {
        port: admin,
        child: shell.spawn().unwrap(),
    };
    for port in [admin, metrics] {
        wait_for("the listeners", || {
            request(port, "GET", "/healthz", None, None, &[]).filter(|r| r.0 == 200)
        });
    }

    let start = Instant::now();
    let mut held = hold(metrics, HELD);
    held.extend(hold(admin, HELD));
    db.enqueue("held.orders.v1", None, "delivered-while-held");
    for port in [metrics, admin] {
        let asked = Instant::now();
        let (code, body) = request(port, "GET", "/healthz", None, None, &[])
            .unwrap_or_else(|| panic!("{what}: /healthz on {port} did not answer"));
        assert_eq!((code, body.as_str()), (200, "ok\n"));
        assert!(
            asked.elapsed() < Duration::from_secs(8),
            "{what}: /healthz took {:?}",
            asked.elapsed()
        );
    }
    wait_for(
        "the relay's delivery while the connections are held",
        || {
            std::fs::read_to_string(&out)
                .ok()
                .filter(|t| t.contains("delivered-while-held"))
        },
    );
    let open = still_open(&mut held, start + Duration::from_secs(15));
    assert_eq!(
        open,
        0,
        "{what}: of {} half-sent requests, {open} still open after {:?} (header-read timeout 1 s)",
        held.len(),
        start.elapsed()
    );
}

/// Writes `head` and `body` to a new connection from a thread of its own (the server may
/// answer before it reads the whole body) and reads the answer: (status, head, body).
fn raw(port: u16, head: String, body: Vec<u8>) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(head.as_bytes());
        let _ = w.write_all(&body);
    });
    let mut answer = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    drop(s);
    let _ = writer.join();
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer: {:?}", String::from_utf8_lossy(&answer)));
    let head = String::from_utf8_lossy(&answer[..split]).into_owned();
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, head, answer[split + 4..].to_vec())
}

/// A GET with `token`: (status, head, body).
fn get(port: u16, path: &str, token: &str) -> (u16, String, Vec<u8>) {
    raw(
        port,
        format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
        ),
        Vec::new(),
    )
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// An oversized body is 413; answers that carry dead letters and payloads say
/// `Cache-Control: no-store`; a payload larger than the preview is shown cut, with its
/// full size, and downloaded whole; `since=500000y` is a 400 that says why.
#[test]
fn admin_api_limits_and_payload_preview() {
    let db = Db::new(Some(PG));
    run_ok(db.cmd().arg("migrate"));
    // 200 KiB of text, dead for want of a route.
    let big: String = (0..200 * 1024)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let mut enqueue = db
        .cmd()
        .args(["enqueue", "--topic", "big.blob.v1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    enqueue
        .stdin
        .take()
        .unwrap()
        .write_all(big.as_bytes())
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
    let port = server.port;

    // 3 MB of JSON: refused as too large, nothing parsed.
    let body = format!(
        "{{\"reason\":\"r\",\"ids\":[{}]}}",
        vec!["1"; 1_500_000].join(",")
    );
    let (code, _, answer) = raw(
        port,
        format!(
            "POST /api/dead/replay HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {DANA}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        ),
        body.into_bytes(),
    );
    assert_eq!(code, 413, "{}", String::from_utf8_lossy(&answer));

    // Not cached: the list and one dead letter with its payload.
    let (code, head, _) = get(port, "/api/dead", READER);
    assert_eq!(code, 200, "{head}");
    assert_eq!(header(&head, "cache-control"), Some("no-store"), "{head}");
    let path = format!("/api/dead/{}?payload=true", row["id"]);
    let (code, head, shown) = get(port, &path, DANA);
    assert_eq!(code, 200, "{head}");
    assert_eq!(header(&head, "cache-control"), Some("no-store"), "{head}");

    // The preview is cut at 64 KiB and says so; the download is the whole payload.
    let shown: Value = serde_json::from_slice(&shown).unwrap();
    assert_eq!(shown["payload_bytes"], 200 * 1024);
    let text = shown["payload_text"].as_str().unwrap();
    assert_eq!(text.len(), 64 * 1024, "a bounded preview");
    assert!(big.starts_with(text));
    assert_eq!(
        shown["payload_truncated"], true,
        "{}",
        shown["payload_truncated"]
    );
    let download = format!("/api/dead/{}/payload", row["id"]);
    let (code, head, bytes) = get(port, &download, DANA);
    assert_eq!(code, 200, "{head}");
    assert_eq!(bytes, big.as_bytes(), "the whole payload, as it is");
    assert_eq!(header(&head, "cache-control"), Some("no-store"), "{head}");
    assert_eq!(
        header(&head, "content-type"),
        Some("application/octet-stream")
    );
    assert!(
        header(&head, "content-disposition").is_some_and(|d| d.starts_with("attachment")),
        "{head}"
    );
    let (code, _, _) = get(port, &download, READER);
    assert_eq!(code, 403, "payloads are for operator tokens");

    // A duration reaching back past what a time can say: the caller's mistake.
    let (code, v) = api.get("/api/dead?since=500000y", Some(READER));
    assert_eq!(code, 400, "{v}");
    assert!(error_of(&v).contains("500000y"), "{v}");
    assert!(error_of(&v).contains("at most"), "{v}");
    let (code, v) = api.get("/api/dead?since=36500d", Some(READER));
    assert_eq!(code, 200, "a hundred years is fine: {v}");
}

/// A token of one repeated character, or of spaces only, is no secret: refused before the
/// server listens, with exit 2 and the variable named.
#[test]
fn guessable_tokens_are_refused_at_start() {
    let db = Db::new(None);
    run_ok(db.cmd().arg("migrate"));
    for (var, token) in [
        ("OUTBOX_ADMIN_TOKEN", "aaaaaaaaaaaaaaaaaaaaaaaa"),
        ("OUTBOX_ADMIN_READ_TOKEN", "                        "),
    ] {
        let mut child = db
            .cmd()
            .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port())])
            .env(var, token)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // A server that took the token would serve until stopped.
        crate::common::wait_for(
            "the server to refuse the token",
            Duration::from_secs(20),
            || child.try_wait().unwrap(),
        );
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}: {err}");
        assert!(err.contains(var), "{err}");
        assert!(
            err.contains("one character repeated") || err.contains("only spaces"),
            "{err}"
        );
    }
}

/// Opens `n` connections to `port` with a 1 KiB receive buffer, each with `requests`
/// pipelined `GET {path}` to send (non-blocking: [`push`] sends what the server takes).
fn pipeliners(port: u16, n: usize, path: &str, token: &str, requests: usize) -> Vec<Pipeliner> {
    let one = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n\r\n"
    );
    // Requests back to back, a 64 KiB write's worth and one more to start anywhere in one.
    let many = std::rc::Rc::new(one.repeat(64 * 1024 / one.len() + 2).into_bytes());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (0..n)
        .map(|_| {
            let stream = runtime.block_on(async {
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.set_recv_buffer_size(1024).unwrap();
                socket
                    .connect(([127, 0, 0, 1], port).into())
                    .await
                    .unwrap()
                    .into_std()
                    .unwrap()
            });
            stream.set_nonblocking(true).unwrap();
            Pipeliner {
                stream,
                left: one.len() * requests,
                one: one.len(),
                many: many.clone(),
                closed: false,
            }
        })
        .collect()
}

/// A connection that sends pipelined requests and never reads.
struct Pipeliner {
    stream: TcpStream,
    /// The length of one request.
    one: usize,
    /// Requests back to back.
    many: std::rc::Rc<Vec<u8>>,
    /// Bytes still to send.
    left: usize,
    /// A write failed: the server closed the connection.
    closed: bool,
}

/// Sends each of `all` what the server takes now; true while some still have bytes to
/// send.
fn push(all: &mut [Pipeliner]) -> bool {
    let mut busy = false;
    for p in all.iter_mut().filter(|p| !p.closed && p.left > 0) {
        loop {
            let at = (p.one - p.left % p.one) % p.one;
            let chunk = &p.many[at..(at + 64 * 1024).min(at + p.left)];
            match p.stream.write(chunk) {
                Ok(n) => p.left -= n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    p.closed = true;
                    break;
                }
            }
            if p.left == 0 {
                break;
            }
        }
        busy |= !p.closed && p.left > 0;
    }
    busy
}

/// Connections that never read, on each listener: more than its connection limit (32 in
/// the relay below).
const ATTACKERS: usize = 40;

/// 40 connections on each listener (more than its connection limit) that pipeline
/// more requests than the socket buffers hold answers for and never read them: with a
/// write timeout of 1 s (and a header-read timeout of an hour) the
/// server closes each once its answers stop leaving, `/healthz` from a new connection
/// answers, and every one of them is closed.
#[test]
fn clients_that_never_read_do_not_hold_the_listeners() {
    let db = Db::new(None);
    run_ok(db.cmd().arg("migrate"));
    let (admin, metrics) = (free_port(), free_port());
    // 128 descriptors: a connection limit of 32 per listener, few enough answers to make
    // for every connection to stall soon.
    let relay = db.cmd();
    let _relay = Server {
        port: admin,
        child: std::process::Command::new("sh")
            .arg("-c")
            .arg("ulimit -n 128 && exec \"$0\" \"$@\"")
            .arg(relay.get_program())
            .args(relay.get_args())
            .envs(
                relay
                    .get_envs()
                    .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))),
            )
            .args(["relay", "--sink", "stdout", "--poll-interval-ms", "200"])
            .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
            .env_remove("OUTBOX_ADMIN_TOKEN")
            .env_remove("OUTBOX_ADMIN_TOKENS_FILE")
            .env("OUTBOX_ADMIN_READ_TOKEN", READER)
            .env("OUTBOX_HTTP_WRITE_TIMEOUT", "1s")
            // Only the write timeout may free them.
            .env("OUTBOX_HTTP_HEADER_TIMEOUT", "1h")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    };
    for port in [admin, metrics] {
        wait_for("the listeners", || {
            request(port, "GET", "/healthz", None, None, &[]).filter(|r| r.0 == 200)
        });
    }
    let mut attackers = pipeliners(admin, ATTACKERS, "/healthz", READER, 200_000);
    attackers.extend(pipeliners(metrics, ATTACKERS, "/metrics", READER, 2_000));
    // Until every connection is stuck: nothing more goes out for a while.
    let start = Instant::now();
    let mut quiet_since = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        let before: usize = attackers.iter().map(|p| p.left).sum();
        if !push(&mut attackers) {
            break;
        }
        let after: usize = attackers.iter().map(|p| p.left).sum();
        if after != before {
            quiet_since = Instant::now();
        } else if quiet_since.elapsed() > Duration::from_millis(300) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for port in [metrics, admin] {
        let asked = Instant::now();
        let answer = request(port, "GET", "/healthz", None, None, &[]);
        assert_eq!(
            answer,
            Some((200, "ok\n".to_owned())),
            "/healthz on {port} while clients that never read hold it ({:?})",
            asked.elapsed()
        );
        assert!(
            asked.elapsed() < Duration::from_secs(8),
            "/healthz on {port} took {:?}",
            asked.elapsed()
        );
    }
    // Every attacker connection is closed by the server (its writes fail) soon after.
    crate::common::wait_for(
        "every connection that never read closed",
        Duration::from_secs(20),
        || {
            for p in attackers.iter_mut().filter(|p| !p.closed) {
                for _ in 0..2 {
                    match p.stream.write(b"GET /healthz HTTP/1.1\r\n\r\n") {
                        Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => p.closed = true,
                        _ => {}
                    }
                }
            }
            let open = attackers.iter().filter(|p| !p.closed).count();
            (open == 0).then_some(())
        },
    );
    // `/metrics` is not kept by a browser or a proxy, on either listener.
    for port in [admin, metrics] {
        let (code, head, _) = get(port, "/metrics", READER);
        assert_eq!(code, 200, "{head}");
        assert_eq!(
            header(&head, "cache-control"),
            Some("no-store"),
            "/metrics on {port}: {head}"
        );
    }
}
