//! `relay --create-missing`: the JetStream streams a route to NATS needs, checked at start
//! (what is missing said on stderr) and, with the flag, created.

use crate::common::{jetstream, outbox, run_ok, unique};

/// A route whose pattern no stream covers: the relay says so and how to fix it, the
/// message is quarantined and the drain exits 4. With --create-missing the stream is
/// created (named after the pattern) and the next message is delivered into it; a second
/// start finds it and says nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_checks_and_creates_missing_jetstream_streams() {
    let prefix = unique("streams");
    let stream = prefix.to_uppercase();
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("s.db").display());
    let route = format!("{prefix}.>=nats://127.0.0.1:4222");
    let topic = format!("{prefix}.order-placed.v1");
    run_ok(outbox().args(["--database-url", &db, "migrate"]));
    let enqueue = || {
        run_ok(outbox().args([
            "--database-url",
            &db,
            "enqueue",
            "--topic",
            &topic,
            "--payload",
            "{}",
        ]));
    };

    // `relay --route ROUTE --drain` with `extra` flags: its exit code and stderr.
    let drain = |extra: &[&str]| {
        let out = outbox()
            .args(["--database-url", &db, "relay", "--route", &route, "--drain"])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    enqueue();
    let (code, stderr) = drain(&[]);
    assert_eq!(code, Some(4), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "no JetStream stream on nats://127.0.0.1:4222 covers route \"{prefix}.>\""
        )) && stderr.contains(&format!("--create-missing (creates stream {stream})")),
        "{stderr}"
    );

    enqueue();
    let (code, stderr) = drain(&["--create-missing"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "created JetStream stream {stream} (subjects \"{prefix}.>\""
        )),
        "{stderr}"
    );
    let js = jetstream().await;
    let mut created = js.get_stream(&stream).await.unwrap();
    let info = created.info().await.unwrap();
    assert_eq!(info.config.subjects, vec![format!("{prefix}.>")]);
    assert_eq!(
        info.state.messages, 1,
        "the second message went into the new stream"
    );

    // Covered now: nothing to say, nothing created again.
    let (code, stderr) = drain(&["--create-missing"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("JetStream stream"), "{stderr}");
    js.delete_stream(&stream).await.unwrap();
}
