//! Redis Streams: stream keys under a prefix of their own per instance, read back with
//! `XRANGE`; the documented entry fields map back to the envelope (`key` empty = none,
//! `headers` a JSON object of the stored headers).

use super::{Harness, Received, closed_port, poll_read};
use crate::common::unique;
use async_trait::async_trait;
use outbox::sink::redis_streams::RedisStreamsSink;
use outbox::sink::{Sink, SinkError};
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use std::collections::HashMap;
use std::time::Duration;

/// Redis of this machine; `OUTBOX_TEST_REDIS_URL` overrides it.
pub(crate) fn redis_url() -> String {
    std::env::var("OUTBOX_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A connection of its own, failing loudly with how to start Redis.
pub(crate) async fn admin() -> MultiplexedConnection {
    let url = redis_url();
    let client = redis::Client::open(url.as_str()).unwrap();
    match tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    {
        Ok(Ok(c)) => c,
        other => panic!(
            "Redis is not reachable at {url} ({:?}). Start it with `redis-server --daemonize yes \
             --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no --dir /var/lib/redis \
             --logfile /var/log/redis/ci.log` (Debian package redis-server). Set \
             OUTBOX_TEST_REDIS_URL to use another server.",
            other.map(|r| r.err())
        ),
    }
}

/// Every entry of `stream`: (entry id, field → raw bytes).
pub(crate) async fn entries(
    c: &mut MultiplexedConnection,
    stream: &str,
) -> Vec<(String, HashMap<String, Vec<u8>>)> {
    let reply: redis::streams::StreamRangeReply = c.xrange_all(stream).await.unwrap();
    reply
        .ids
        .into_iter()
        .map(|e| {
            let fields = e
                .map
                .into_iter()
                .map(|(k, v)| {
                    let bytes: Vec<u8> = redis::from_redis_value(v).unwrap();
                    (k, bytes)
                })
                .collect();
            (e.id, fields)
        })
        .collect()
}

/// A field of an entry as text.
pub(crate) fn text(fields: &HashMap<String, Vec<u8>>, name: &str) -> String {
    String::from_utf8(
        fields
            .get(name)
            .unwrap_or_else(|| panic!("no field {name}"))
            .clone(),
    )
    .unwrap()
}

/// Every entry of `stream`, read back with the library's decoder.
async fn envelopes(c: &mut MultiplexedConnection, stream: &str) -> Vec<Received> {
    let reply: redis::streams::StreamRangeReply = c.xrange_all(stream).await.unwrap();
    reply
        .ids
        .iter()
        .map(|e| Received::from(outbox::envelope::from_redis(e).unwrap()))
        .collect()
}

pub(crate) struct RedisHarness {
    conn: MultiplexedConnection,
    prefix: String,
    streams: Vec<String>,
}

#[async_trait]
impl Harness for RedisHarness {
    const DEDUPLICATES: bool = false;
    const PERMANENT_CODE: &'static str = "wrong_type";

    async fn setup() -> Self {
        RedisHarness {
            conn: admin().await,
            prefix: format!("outbox.test.{}", unique()),
            streams: Vec::new(),
        }
    }

    /// One stream for every label: the harness reads one destination.
    fn topic(&self, _label: &str) -> String {
        format!("{}.stream", self.prefix)
    }

    async fn sink(&self) -> Box<dyn Sink> {
        Box::new(RedisStreamsSink::connect(&redis_url()).await.unwrap())
    }

    async fn size_limit(&self) -> Option<usize> {
        None
    }

    async fn read(&mut self, expected: usize) -> Vec<Received> {
        let stream = self.topic("");
        let conn = self.conn.clone();
        poll_read(
            expected,
            Duration::from_secs(10),
            Duration::from_millis(100),
            || {
                let mut c = conn.clone();
                let stream = stream.clone();
                async move { envelopes(&mut c, &stream).await }
            },
        )
        .await
    }

    async fn down_sink() -> Result<Box<dyn Sink>, SinkError> {
        let url = format!("redis://127.0.0.1:{}", closed_port());
        Ok(Box::new(RedisStreamsSink::connect(&url).await?))
    }

    async fn permanent_topic(&mut self) -> String {
        // A key that exists and is not a stream: WRONGTYPE.
        let key = format!("{}.plain-string", self.prefix);
        let _: () = self.conn.set(&key, "not a stream").await.unwrap();
        self.streams.push(key.clone());
        key
    }

    async fn cleanup(mut self) {
        let mut keys = std::mem::take(&mut self.streams);
        keys.push(self.topic(""));
        let _: redis::RedisResult<()> = self.conn.del(keys).await;
    }
}
