//! The `Router` as a sink: two routes (`router.a.>` and `router.b.>`) to two file sinks,
//! no catch-all. Labels alternate between the routes, reading back merges both files, and
//! a topic no route matches is the permanent case. Down: a route to a NATS server that is
//! not running.

use super::{Harness, Received};
use async_trait::async_trait;
use outbox::OutgoingMessage;
use outbox::sink::file::FileSink;
use outbox::sink::router::{Router, RouterOptions, TopicPattern};
use outbox::sink::{Confirmations, Sink, SinkError};
use std::sync::Arc;
use std::time::Duration;
use tempfile::TempDir;

/// A [`Router`] behind the `Sink` trait, with one timeout for every group.
struct Routed {
    router: Router,
}

#[async_trait]
impl Sink for Routed {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        self.router
            .publish(batch, confirm, Duration::from_secs(10))
            .await;
    }

    fn describe(&self) -> String {
        self.router.describe()
    }

    async fn close(&self) {
        self.router.close().await;
    }
}

fn route(pattern: &str, sink: Arc<dyn Sink>) -> (TopicPattern, Arc<dyn Sink>) {
    (TopicPattern::parse(pattern).unwrap(), sink)
}

pub(crate) struct RouterHarness {
    dir: TempDir,
}

impl RouterHarness {
    fn file(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }
}

#[async_trait]
impl Harness for RouterHarness {
    const DEDUPLICATES: bool = false;
    const PERMANENT_CODE: &'static str = "no_route";

    async fn setup() -> Self {
        RouterHarness {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Labels of even length go to route a, the others to route b.
    fn topic(&self, label: &str) -> String {
        let r = if label.len().is_multiple_of(2) {
            "a"
        } else {
            "b"
        };
        format!("router.{r}.{label}")
    }

    async fn sink(&self) -> Box<dyn Sink> {
        let a: Arc<dyn Sink> = Arc::new(FileSink::open(self.file("a.jsonl")).await.unwrap());
        let b: Arc<dyn Sink> = Arc::new(FileSink::open(self.file("b.jsonl")).await.unwrap());
        let routes = vec![route("router.a.>", a), route("router.b.>", b)];
        Box::new(Routed {
            router: Router::new(routes, RouterOptions::default()),
        })
    }

    async fn size_limit(&self) -> Option<usize> {
        None
    }

    async fn read(&mut self, expected: usize) -> Vec<Received> {
        let mut got = Vec::new();
        for name in ["a.jsonl", "b.jsonl"] {
            let bytes = std::fs::read(self.file(name)).unwrap_or_default();
            for line in bytes.split_inclusive(|b| *b == b'\n') {
                let e = outbox::envelope::from_json_line(line).unwrap();
                let route = if name == "a.jsonl" {
                    "router.a."
                } else {
                    "router.b."
                };
                assert!(e.topic.starts_with(route), "{} in {name}", e.topic);
                got.push(Received::from(e));
            }
        }
        assert!(got.len() >= expected, "{} of {expected}", got.len());
        got
    }

    async fn down_sink() -> Result<Box<dyn Sink>, SinkError> {
        let nats = <super::nats::NatsHarness as Harness>::down_sink().await?;
        Ok(Box::new(Routed {
            router: Router::new(vec![route(">", Arc::from(nats))], RouterOptions::default()),
        }))
    }

    /// No route matches it.
    async fn permanent_topic(&mut self) -> String {
        "unrouted.topic".into()
    }

    async fn cleanup(self) {}
}
