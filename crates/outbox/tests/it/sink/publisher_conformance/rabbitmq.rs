//! RabbitMQ: a durable queue of its own per instance, reached through the default exchange
//! (routing key = queue name), read back with `basic.get`; the envelope from the headers
//! table, `message_id` from the AMQP property.

use super::{Harness, Received, closed_port};
use crate::common::unique;
use async_trait::async_trait;
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};
use outbox::sink::rabbitmq::RabbitMqSink;
use outbox::sink::{Sink, SinkError};
use std::time::Duration;

/// RabbitMQ of this machine; `OUTBOX_TEST_AMQP_URL` overrides it.
pub(crate) fn amqp_url() -> String {
    std::env::var("OUTBOX_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A channel of a connection of its own, failing loudly with how to start RabbitMQ.
pub(crate) async fn admin() -> (Connection, Channel) {
    let url = amqp_url();
    let conn = match tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(&url, ConnectionProperties::default()),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => panic!(
            "RabbitMQ is not reachable at {url} ({e}). Start it with `rabbitmq-server -detached` \
             (Debian package rabbitmq-server; user guest/guest on loopback). Set \
             OUTBOX_TEST_AMQP_URL to use another broker."
        ),
        Err(_) => panic!(
            "RabbitMQ at {url} did not answer within 5 s. Start it with `rabbitmq-server -detached`."
        ),
    };
    let channel = conn.create_channel().await.unwrap();
    (conn, channel)
}

/// A header of the table as text (every envelope value is a long string).
pub(crate) fn header_text(table: &FieldTable, name: &str) -> Option<String> {
    match table.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8(s.as_bytes().to_vec()).unwrap()),
        other => panic!("header {name} is {other:?}, expected a long string"),
    }
}

/// `ENVELOPE`: [`super::OUTBOX`], [`super::CE`] or [`super::CE_STRUCTURED`].
pub(crate) struct RabbitMqHarness<const ENVELOPE: u8 = { super::OUTBOX }> {
    _conn: Connection,
    ch: Channel,
    queue: String,
    /// Everything taken from the queue so far (`basic.get` consumes).
    taken: Vec<Received>,
}

impl<const ENVELOPE: u8> RabbitMqHarness<ENVELOPE> {
    async fn take_available(&mut self) {
        while let Some(got) = self
            .ch
            .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let d = &got.delivery;
            let env = outbox::envelope::from_amqp(d).unwrap();
            let property = d.properties.message_id().as_ref().unwrap().as_str();
            assert_eq!(property, env.message_id.to_string(), "message_id property");
            assert_eq!(d.routing_key.as_str(), env.topic, "routing key = topic");
            self.taken.push(Received::from(env));
        }
    }
}

#[async_trait]
impl<const ENVELOPE: u8> Harness for RabbitMqHarness<ENVELOPE> {
    const DEDUPLICATES: bool = false;
    const PERMANENT_CODE: &'static str = "unroutable";

    async fn setup() -> Self {
        let (conn, ch) = admin().await;
        let queue = format!("outbox.test.{}", unique());
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        RabbitMqHarness {
            _conn: conn,
            ch,
            queue,
            taken: Vec::new(),
        }
    }

    /// The default exchange routes by queue name: every label goes to the one queue.
    fn topic(&self, _label: &str) -> String {
        self.queue.clone()
    }

    async fn sink(&self) -> Box<dyn Sink> {
        Box::new(
            RabbitMqSink::connect(&super::with_envelope(&amqp_url(), ENVELOPE, ""))
                .await
                .unwrap(),
        )
    }

    async fn size_limit(&self) -> Option<usize> {
        None
    }

    async fn read(&mut self, expected: usize) -> Vec<Received> {
        let me = tokio::sync::Mutex::new(self);
        let me = &me;
        super::poll_read(
            expected,
            Duration::from_secs(10),
            Duration::from_millis(200),
            || async move {
                let mut me = me.lock().await;
                me.take_available().await;
                me.taken.clone()
            },
        )
        .await
    }

    async fn down_sink() -> Result<Box<dyn Sink>, SinkError> {
        let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port());
        Ok(Box::new(RabbitMqSink::connect(&url).await?))
    }

    async fn permanent_topic(&mut self) -> String {
        // No queue is named like it: unroutable on the default exchange.
        format!("no.such.queue.{}", unique())
    }

    async fn cleanup(self) {
        let _ = self
            .ch
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}
