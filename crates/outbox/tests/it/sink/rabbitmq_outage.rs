//! A RabbitMQ outage at default relay settings, against a private RabbitMQ node this test
//! starts, stops (`rabbitmqctl stop`, as a node restart does) and starts again: while it is
//! down a producer keeps writing; nothing is quarantined, no attempt is counted, and the
//! whole backlog reaches the queue within 5 s of the node accepting again.

#![cfg(feature = "rabbitmq")]
#![allow(clippy::unwrap_used)]

use crate::common::{
    assert_outage_spent_nothing, free_port, messages, outage_length, produce_for, wait_dispatched,
};
use crate::store::conformance::Backend as _;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use outbox::sink::rabbitmq::RabbitMqSink;
use outbox::{Relay, RelayConfig};
use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A RabbitMQ node of its own: own node name, ports, database and logs.
pub(crate) struct Node {
    name: String,
    pub(crate) port: u16,
    dist_port: u16,
    pub(crate) dir: tempfile::TempDir,
    /// The user the node was created with (`guest`, or the TLS test's own).
    user: (String, String),
}

impl Node {
    async fn start() -> Self {
        Self::start_with(|_| String::new(), ("guest", "guest")).await
    }

    /// A node whose configuration gets `extra(dir)` appended (the node's directory, where
    /// files it reads must be, since the server drops to the rabbitmq user) and whose
    /// first user is `user` (name, password).
    pub(crate) async fn start_with(
        extra: impl FnOnce(&std::path::Path) -> String,
        user: (&str, &str),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let node = Node {
            name: format!("outbox-test-{port}@localhost"),
            port,
            dist_port: free_port(),
            dir,
            user: (user.0.to_owned(), user.1.to_owned()),
        };
        let d = node.dir.path();
        std::fs::create_dir_all(d.join("mnesia")).unwrap();
        std::fs::create_dir_all(d.join("log")).unwrap();
        std::fs::write(d.join("plugins"), "[].").unwrap();
        std::fs::write(
            d.join("rabbitmq.conf"),
            format!(
                "listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n\
                 default_user = {}\ndefault_pass = {}\n{}",
                user.0,
                user.1,
                extra(d)
            ),
        )
        .unwrap();
        // The server drops to the rabbitmq user: it must own its directories.
        let _ = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(d)
            .status();
        let _ = Command::new("chmod").args(["755"]).arg(d).status();
        node.run().await;
        node
    }

    pub(crate) fn url(&self) -> String {
        format!(
            "amqp://{}:{}@127.0.0.1:{}/%2f",
            self.user.0, self.user.1, self.port
        )
    }

    fn env(&self, c: &mut Command) {
        let d: PathBuf = self.dir.path().to_owned();
        c.env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("plugins"));
    }

    /// Starts the node (again, on the same port and database); waits until it accepts.
    async fn run(&self) {
        let mut c = Command::new("rabbitmq-server");
        self.env(&mut c);
        // The server runs until `stop`; a thread reaps it then.
        let mut child = c
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run rabbitmq-server ({e}): install it with `apt-get install rabbitmq-server`")
            });
        std::thread::spawn(move || child.wait());
        let what = format!("the private RabbitMQ node to come up on port {}", self.port);
        // Each attempt is bounded: a connection the booting node accepts and then drops can
        // leave lapin's handshake waiting forever, with nothing left to wake it.
        crate::common::wait_until(&what, Duration::from_secs(120), || async {
            match tokio::time::timeout(
                Duration::from_secs(5),
                Connection::connect(&self.url(), ConnectionProperties::default()),
            )
            .await
            {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no handshake within 5 s".into()),
            }
        })
        .await;
    }

    /// Stops the node as an operator would (`rabbitmqctl stop`).
    fn stop(&self) {
        let mut c = Command::new("rabbitmqctl");
        self.env(&mut c);
        let ok = c
            .args(["-n", &self.name, "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success();
        assert!(ok, "rabbitmqctl stop failed for {}", self.name);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let mut c = Command::new("rabbitmqctl");
        self.env(&mut c);
        let _ = c
            .args(["-n", &self.name, "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_rabbitmq_outage_recovers_within_seconds() {
    let outage = outage_length();
    let node = Node::start().await;
    let queue = "outbox.outage.v1";
    {
        let conn = Connection::connect(&node.url(), ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        let _ = conn.close(200, "ok".into()).await;
    }

    let db = Arc::new(
        crate::store::conformance_postgres::PgBackend::create(
            "rmq_outage",
            crate::store::conformance::DEFAULT_MAX,
        )
        .await,
    );
    let store = db.store();
    let sink = RabbitMqSink::connect(&node.url()).await.unwrap();
    let cfg = RelayConfig {
        relay_id: "relay-rmq-outage".into(),
        ..RelayConfig::default()
    };
    let handle = Relay::new(store.clone(), Arc::new(sink), cfg).spawn();
    let mut enq = db.enqueue_all(&messages(queue, 10)).await;
    wait_dispatched("healthy delivery", &store, 10, Duration::from_secs(10)).await;

    node.stop();
    enq.extend(produce_for(db.clone(), queue.to_owned(), outage).await);
    let n = enq.len();
    assert_outage_spent_nothing(&*db).await;

    node.run().await;
    let back = Instant::now();
    wait_dispatched("the backlog delivered", &store, n, Duration::from_secs(60)).await;
    let took = back.elapsed();
    eprintln!(
        "{} messages enqueued during a {outage:?} RabbitMQ outage delivered {took:?} after the node accepted again",
        n - 10
    );
    assert!(
        took < Duration::from_secs(5),
        "backlog took {took:?} after the node's return"
    );
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.quarantined, 0, "{stats:?}");

    // Every message is in the queue (a publish cut by the shutdown may be there twice).
    let conn = Connection::connect(&node.url(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let mut seen = HashSet::new();
    let mut copies = 0;
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        copies += 1;
        let id = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(ToString::to_string)
            .unwrap();
        seen.insert(id);
    }
    let ours: HashSet<String> = enq.iter().map(|e| e.message_id.to_string()).collect();
    assert_eq!(seen, ours);
    eprintln!("{copies} copies in the queue for {n} messages");
}
