//! The Sidekiq sink against the machine's Redis and a real Sidekiq (Debian's
//! `ruby-sidekiq`, installed by `scripts/test`): `Ok` only once the transaction replied,
//! with the queue registered and each job in Sidekiq's format, oldest at the end Sidekiq
//! takes from; a queue key that is not a list is permanent; a server that cannot be
//! reached is unavailable; a relay's 500 messages are run by a Sidekiq worker process, each
//! job once, with its payload and envelope as arguments; a relay that dies after Redis
//! replied and before its mark loses no job (the next relay pushes those again, same jid).
//!
//! Each test uses its own queue (deleted afterwards, even on panic).

#![cfg(feature = "redis")]
#![allow(clippy::unwrap_used)]

use crate::common::{relay_config, sqlite_store, unique};
use crate::sink::publisher_conformance::redis::{admin, redis_url};
use outbox::events::Enqueue as _;
use outbox::message::Message;
use outbox::sink::sidekiq::SidekiqSink;
use outbox::sink::{ErrorKind, Sink};
use outbox::{OutgoingMessage, Relay};
use redis::AsyncCommands;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One test's queue: `queue:NAME` and its entry in `queues`, removed when dropped.
struct Queue(String);

impl Queue {
    fn new() -> Self {
        Queue(format!("outbox-test-{}", unique()))
    }

    fn url(&self, class: &str) -> String {
        format!(
            "{}?class={class}&queue={}",
            redis_url().replacen("redis://", "sidekiq://", 1),
            self.0
        )
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        let name = self.0.clone();
        let _ = std::thread::spawn(move || {
            let Ok(client) = redis::Client::open(redis_url().as_str()) else {
                return;
            };
            let Ok(mut c) = client.get_connection_with_timeout(Duration::from_secs(3)) else {
                return;
            };
            let _: redis::RedisResult<()> =
                redis::cmd("DEL").arg(format!("queue:{name}")).query(&mut c);
            let _: redis::RedisResult<()> =
                redis::cmd("SREM").arg("queues").arg(&name).query(&mut c);
        })
        .join();
    }
}

fn outgoing(id: i64, payload: &[u8], content_type: Option<&str>) -> OutgoingMessage {
    let mut m =
        crate::sink::publisher_conformance::outgoing(id, "emails.welcome", None, payload.to_vec());
    if let Some(t) = content_type {
        m.headers.insert("content-type".into(), t.into());
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_jobs_are_on_the_registered_queue_in_sidekiqs_format() {
    let mut admin = admin().await;
    let queue = Queue::new();
    let mut batch = vec![
        outgoing(1, br#"{"user_id":42}"#, Some("application/json")),
        outgoing(2, b"plain text", Some("text/plain")),
        outgoing(3, &[0xff, 0xfe, 0x00], None),
    ];
    batch[0].key = Some("user-42".into());
    batch[1].headers.insert("tenant".into(), "grüße ✓".into());

    let sink = SidekiqSink::connect(&queue.url("WelcomeJob"))
        .await
        .unwrap();
    assert!(sink.describe().contains(&queue.0), "{}", sink.describe());
    let results = sink.publish_all(&batch).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");

    // Ok means EXEC replied: the queue is registered and holds the jobs.
    let registered: bool = admin.sismember("queues", &queue.0).await.unwrap();
    assert!(registered, "SADD queues");
    let mut jobs: Vec<String> = admin
        .lrange(format!("queue:{}", queue.0), 0, -1)
        .await
        .unwrap();
    // BRPOP takes from the right: the first message is the last element.
    jobs.reverse();
    assert_eq!(jobs.len(), 3);
    let expected_args0 = [json!({"user_id": 42}), json!("plain text"), json!("//4A")];
    for ((sent, job), arg0) in batch.iter().zip(&jobs).zip(expected_args0) {
        let job: Value = serde_json::from_str(job).unwrap();
        assert_eq!(job["class"], "WelcomeJob");
        assert_eq!(job["queue"], queue.0.as_str());
        assert_eq!(job["retry"], true);
        assert_eq!(job["jid"], sent.message_id.simple().to_string());
        assert!(job["enqueued_at"].as_f64().unwrap() >= job["created_at"].as_f64().unwrap());
        assert_eq!(job["args"][0], arg0, "payload of {}", sent.id);
        let envelope = &job["args"][1];
        assert_eq!(envelope["message_id"], sent.message_id.to_string());
        assert_eq!(envelope["topic"], "emails.welcome");
        assert_eq!(envelope["key"], json!(sent.key));
        for (name, value) in &sent.headers {
            assert_eq!(envelope["headers"][name], value.as_str(), "header {name}");
        }
    }
    let third: Value = serde_json::from_str(&jobs[2]).unwrap();
    assert_eq!(third["args"][1]["payload_encoding"], "base64");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_key_that_is_not_a_list_is_permanent() {
    let mut admin = admin().await;
    let queue = Queue::new();
    let _: () = admin
        .set(format!("queue:{}", queue.0), "not a list")
        .await
        .unwrap();
    let sink = SidekiqSink::connect(&queue.url("WelcomeJob"))
        .await
        .unwrap();
    let results = sink
        .publish_all(&[outgoing(1, b"{}", None), outgoing(2, b"{}", None)])
        .await;
    for r in results {
        let e = r.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Permanent, "{e}");
        assert_eq!(e.code.as_str(), "wrong_type", "{e}");
        assert!(e.to_string().contains("not a list"), "{e}");
    }
}

#[tokio::test]
async fn a_server_that_cannot_be_reached_is_unavailable() {
    let sink = SidekiqSink::connect("sidekiq://127.0.0.1:1?class=WelcomeJob")
        .await
        .unwrap();
    let e = sink.publish_all(&[outgoing(1, b"{}", None)]).await[0]
        .clone()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
}

/// The worker the Sidekiq process runs: each job appends its jid and arguments to a file.
const WORKER: &str = r#"
require "sidekiq"
require "json"

class OutboxTestJob
  include Sidekiq::Worker
  sidekiq_options retry: false

  def perform(payload, envelope)
    File.open(ENV.fetch("OUTBOX_TEST_JOBS"), "a") do |f|
      f.flock(File::LOCK_EX)
      f.puts(JSON.generate({ "jid" => jid, "payload" => payload, "envelope" => envelope }))
    end
  end
end
"#;

/// A Sidekiq process, stopped (TERM) when dropped.
struct SidekiqProcess(std::process::Child);

impl Drop for SidekiqProcess {
    fn drop(&mut self) {
        // SAFETY: kill(2) with the pid of a child of ours.
        unsafe { libc::kill(i32::try_from(self.0.id()).unwrap(), libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.0.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A sink that passes `batches` publishes through, then pushes the next one and never
/// returns: a relay that dies after Redis replied, before it marked anything.
struct DiesAfter {
    inner: Arc<dyn Sink>,
    batches: usize,
    published: std::sync::atomic::AtomicUsize,
    died: tokio::sync::Notify,
    /// The jids of the batches pushed and never heard of.
    unheard: std::sync::Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl Sink for DiesAfter {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &outbox::sink::Confirmations) {
        let n = self
            .published
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n < self.batches {
            return self.inner.publish(batch, confirm).await;
        }
        // Pushed, and Redis replied, but the relay never hears of it (it would mark the
        // batch as soon as every slot was filled).
        let unheard = outbox::sink::Confirmations::new(batch.len());
        self.inner.publish(batch, &unheard).await;
        assert_eq!(unheard.confirmed(), batch.len(), "the batch reached Redis");
        self.unheard
            .lock()
            .unwrap()
            .extend(batch.iter().map(|m| m.message_id.simple().to_string()));
        self.died.notify_one();
        std::future::pending::<()>().await;
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// The jobs the worker ran so far (one JSON line each), once at least `n` did, within 60 s.
async fn jobs_run(dir: &std::path::Path, jobs_file: &std::path::Path, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(jobs_file).unwrap_or_default();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        if lines.len() >= n {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "Sidekiq ran {} of {n} jobs in 60 s; its log:\n{}{}",
            lines.len(),
            std::fs::read_to_string(dir.join("sidekiq.log")).unwrap_or_default(),
            std::fs::read_to_string(dir.join("sidekiq.err")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// 500 messages relayed with nothing failing are run by a real Sidekiq worker once each
/// by `jid`, with the payload and the envelope as arguments; then 500 more, the relay
/// stopped dead mid-way (its task aborted: no release, no mark, claims left under their
/// lease) and a second relay finishing after the lease: every job runs, none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidekiq_worker_runs_each_message_the_relay_delivers() {
    const N: usize = 500;
    let queue = Queue::new();
    let dir = tempfile::tempdir().unwrap();
    let worker = dir.path().join("worker.rb");
    let jobs_file = dir.path().join("jobs.jsonl");
    std::fs::write(&worker, WORKER).unwrap();
    let child = std::process::Command::new("sidekiq")
        .arg("-r")
        .arg(&worker)
        .args(["-q", &queue.0, "-c", "2"])
        .env("REDIS_URL", redis_url())
        .env("OUTBOX_TEST_JOBS", &jobs_file)
        .stdout(std::fs::File::create(dir.path().join("sidekiq.log")).unwrap())
        .stderr(std::fs::File::create(dir.path().join("sidekiq.err")).unwrap())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run sidekiq ({e}): install Debian's ruby-sidekiq (scripts/test does)")
        });
    let _sidekiq = SidekiqProcess(child);

    let (sqlite, _db) = sqlite_store().await;
    let mut sent = HashMap::new();
    for i in 0..N {
        let msg = if i % 2 == 0 {
            Message::json("emails.welcome", &json!({"user_id": i})).unwrap()
        } else {
            Message::new("emails.welcome", format!("text {i}").into_bytes())
        };
        let e = sqlite
            .enqueue_alone(&msg.key(format!("user-{i}")))
            .await
            .unwrap();
        let expected = if i % 2 == 0 {
            json!({"user_id": i})
        } else {
            json!(format!("text {i}"))
        };
        sent.insert(e.message_id.to_string(), expected);
    }
    let sink: Arc<dyn Sink> = Arc::new(
        SidekiqSink::connect(&queue.url("OutboxTestJob"))
            .await
            .unwrap(),
    );
    let store: Arc<dyn outbox::Store> = Arc::new(sqlite.clone());
    let mut cfg = relay_config("sidekiq-e2e");
    cfg.drain = true;
    let stats = Relay::new(store.clone(), sink.clone(), cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(stats.dispatched, N as u64);

    // Sidekiq runs them: each job once, with the payload and the envelope.
    let ran = jobs_run(dir.path(), &jobs_file, N).await;
    assert_eq!(ran.len(), N, "each job once");
    for job in &ran {
        let id = job["envelope"]["message_id"].as_str().unwrap();
        let expected = sent
            .remove(id)
            .unwrap_or_else(|| panic!("job for an unknown or repeated id {id}"));
        assert_eq!(job["payload"], expected, "payload of {id}");
        assert_eq!(job["jid"], id.replace('-', ""));
        assert_eq!(job["envelope"]["topic"], "emails.welcome");
        assert!(
            job["envelope"]["key"]
                .as_str()
                .unwrap()
                .starts_with("user-")
        );
    }
    assert!(sent.is_empty(), "never run: {sent:?}");

    // 500 more; the relay dies mid-way (small batches, so it has pushed some and holds
    // others), a second one finishes after its lease.
    let mut second = std::collections::HashSet::new();
    for i in 0..N {
        let msg = Message::json("emails.welcome", &json!({"user_id": N + i})).unwrap();
        let e = sqlite.enqueue_alone(&msg).await.unwrap();
        second.insert(e.message_id.to_string().replace('-', ""));
    }
    let mut cfg = relay_config("sidekiq-killed");
    (cfg.batch_size, cfg.lease) = (20, Duration::from_millis(1_500));
    let gate = Arc::new(DiesAfter {
        inner: sink.clone(),
        batches: 5,
        published: std::sync::atomic::AtomicUsize::new(0),
        died: tokio::sync::Notify::new(),
        unheard: std::sync::Mutex::default(),
    });
    let died = gate.died.notified();
    let killed = tokio::spawn(
        Relay::new(store.clone(), gate.clone(), cfg)
            .run(tokio_util::sync::CancellationToken::new()),
    );
    tokio::time::timeout(Duration::from_secs(60), died)
        .await
        .expect("the relay pushed 6 batches");
    killed.abort();
    let _ = killed.await;
    let c = store.counts().await.unwrap();
    assert!(
        c.dispatched < 2 * N as i64 - 20,
        "killed before the end: {c:?}"
    );
    let mut cfg = relay_config("sidekiq-after");
    cfg.batch_size = 20;
    let cancel = tokio_util::sync::CancellationToken::new();
    let after = tokio::spawn(Relay::new(store.clone(), sink.clone(), cfg).run(cancel.clone()));
    crate::common::wait_dispatched("all 1,000 pushed", &store, 2 * N, Duration::from_secs(60))
        .await;
    cancel.cancel();
    after.await.unwrap().unwrap();
    // The batches pushed and never heard of are pushed again: each of those jobs runs
    // twice, same jid. Wait for that, and for the queue to be empty.
    let unheard = gate.unheard.lock().unwrap().clone();
    assert!(unheard.len() >= 20, "{unheard:?}");
    let mut redis = admin().await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let ran = loop {
        let ran = jobs_run(dir.path(), &jobs_file, 2 * N).await;
        let queued: i64 = redis.llen(format!("queue:{}", queue.0)).await.unwrap();
        let twice = unheard
            .iter()
            .all(|jid| ran.iter().filter(|j| j["jid"] == jid.as_str()).count() >= 2);
        if queued == 0 && twice {
            break ran;
        }
        assert!(
            Instant::now() < deadline,
            "the unheard jobs did not run twice in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let jids: std::collections::HashSet<String> = ran[N..]
        .iter()
        .map(|j| j["jid"].as_str().unwrap().to_owned())
        .collect();
    let lost: Vec<_> = second.difference(&jids).collect();
    assert!(lost.is_empty(), "jobs never run after the kill: {lost:?}");
    assert!(jids.is_subset(&second), "only the second 500 ran again");
    // Duplicates keep their message's jid (what a Sidekiq unique-jobs middleware or the
    // job's own check keys on).
    eprintln!(
        "after the kill: {} runs of {} jobs ({} duplicates, each with its message's jid)",
        ran.len() - N,
        jids.len(),
        ran.len() - N - jids.len()
    );
}
