//! The sink seam: where messages go, and what "confirmed" means for each.
//!
//! A sink publishes a batch and returns one outcome per message, in order. `Ok(())` means
//! the broker confirmed that message (see each sink's docs for what its confirmation
//! promises); an error says whether a retry can help ([`ErrorKind::Transient`]) or not
//! ([`ErrorKind::Permanent`]). Sinks never log payloads.

use crate::message::OutgoingMessage;
use async_trait::async_trait;
use std::fmt;
use std::time::Duration;

pub mod file;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "mqtt")]
pub mod mqtt;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis_streams;
pub mod router;

/// Whether a failed publish may succeed later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Broker down, timeout, throttled: the relay reschedules with backoff.
    Transient,
    /// Can never succeed as it is (too large, unroutable, refused): the relay quarantines.
    Permanent,
    /// The destination could not be reached at all (not connected, the whole batch timed
    /// out). It says nothing about the message: the relay reschedules it with the
    /// relay-wide outage backoff and gives back its attempt, so an outage, however long,
    /// never quarantines a healthy message.
    Unavailable,
}

/// A failed publish of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishError {
    /// Transient or permanent.
    pub kind: ErrorKind,
    /// What failed, for `last_error` and logs (never the payload).
    pub message: String,
    /// The broker asked for at least this long before a retry (e.g. HTTP `Retry-After`).
    pub retry_after: Option<Duration>,
}

impl PublishError {
    /// A transient error.
    pub fn transient(message: impl Into<String>) -> Self {
        PublishError {
            kind: ErrorKind::Transient,
            message: message.into(),
            retry_after: None,
        }
    }

    /// A permanent error.
    pub fn permanent(message: impl Into<String>) -> Self {
        PublishError {
            kind: ErrorKind::Permanent,
            message: message.into(),
            retry_after: None,
        }
    }

    /// The destination is unreachable (see [`ErrorKind::Unavailable`]).
    pub fn unavailable(message: impl Into<String>) -> Self {
        PublishError {
            kind: ErrorKind::Unavailable,
            message: message.into(),
            retry_after: None,
        }
    }

    /// True for [`ErrorKind::Transient`] and [`ErrorKind::Unavailable`]: a retry may work.
    pub fn is_transient(&self) -> bool {
        matches!(self.kind, ErrorKind::Transient | ErrorKind::Unavailable)
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            ErrorKind::Transient => "transient",
            ErrorKind::Permanent => "permanent",
            ErrorKind::Unavailable => "unavailable",
        };
        write!(f, "{kind}: {}", self.message)
    }
}

impl std::error::Error for PublishError {}

/// A sink URL that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// The URL's form is not one this build knows.
    #[error(
        "invalid sink URL {:?}: {reason} (expected stdout, file:PATH, nats://, kafka://, amqp://, redis://, mqtt:// or http(s)://)",
        crate::redact::redact_url(url)
    )]
    InvalidUrl {
        /// The URL, redacted ([`crate::redact::redact_url`]; the message redacts it again,
        /// whoever built the error).
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The sink could not be opened (file not writable, …).
    #[error("cannot open sink {:?}: {source}", crate::redact::redact_url(url))]
    Open {
        /// The URL, redacted (as for [`SinkError::InvalidUrl`]).
        url: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Where messages go. Implement it to add a broker.
#[async_trait]
pub trait Sink: Send + Sync + 'static {
    /// Publishes `batch` and returns exactly one outcome per message, in the same order.
    /// Publishes should be pipelined: send all, then collect confirmations. Must not panic
    /// on any input; the relay bounds the whole call with its publish timeout.
    async fn publish(&self, batch: &[OutgoingMessage]) -> Vec<Result<(), PublishError>>;

    /// Flushes and closes; called once when the relay stops.
    async fn close(&self) {}

    /// A short description for logs (no secrets).
    fn describe(&self) -> String;
}

/// Opens the sink named by `url`:
/// - `stdout`: JSON lines on standard output, confirmed once written and flushed;
/// - `file:PATH`: JSON lines appended to PATH, confirmed once flushed and `fsync`ed;
/// - `nats://HOST:PORT`: NATS JetStream, confirmed by the PubAck (feature `nats`);
/// - `kafka://HOST:PORT`: Kafka, confirmed by the delivery report (feature `kafka`);
/// - `amqp://…`: RabbitMQ, confirmed by the publisher confirm (feature `rabbitmq`);
/// - `redis://…`: Redis Streams, confirmed by the `XADD` reply (feature `redis`);
/// - `mqtt://…`: MQTT 5, confirmed by PUBACK / PUBCOMP (feature `mqtt`);
/// - `http(s)://…`: a webhook, confirmed by a 2xx (feature `http`).
///
/// # Errors
/// [`SinkError::InvalidUrl`] for an unknown or malformed URL, [`SinkError::Open`] when the
/// file cannot be opened.
pub async fn open(url: &str) -> Result<Box<dyn Sink>, SinkError> {
    let invalid = |reason: &str| SinkError::InvalidUrl {
        url: crate::redact::redact_url(url),
        reason: reason.to_owned(),
    };
    if url == "stdout" || url == "stdout:" {
        return Ok(Box::new(file::FileSink::stdout()));
    }
    if let Some(path) = url.strip_prefix("file:") {
        let path = path.strip_prefix("//").unwrap_or(path);
        if path.is_empty() {
            return Err(invalid("file: needs a path"));
        }
        return Ok(Box::new(file::FileSink::open(path).await.map_err(|e| {
            SinkError::Open {
                url: crate::redact::redact_url(url),
                source: Box::new(e),
            }
        })?));
    }
    if url.starts_with("nats://") {
        #[cfg(feature = "nats")]
        return Ok(Box::new(
            nats::NatsSink::connect(url, nats::NatsOptions::default()).await?,
        ));
        #[cfg(not(feature = "nats"))]
        return Err(invalid("this build has no nats feature"));
    }
    if url.starts_with("kafka://") {
        #[cfg(feature = "kafka")]
        return Ok(Box::new(kafka::KafkaSink::connect(url).await?));
        #[cfg(not(feature = "kafka"))]
        return Err(invalid("this build has no kafka feature"));
    }
    if url.starts_with("amqp://") || url.starts_with("amqps://") {
        #[cfg(feature = "rabbitmq")]
        return Ok(Box::new(rabbitmq::RabbitMqSink::connect(url).await?));
        #[cfg(not(feature = "rabbitmq"))]
        return Err(invalid("this build has no rabbitmq feature"));
    }
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        #[cfg(feature = "redis")]
        return Ok(Box::new(
            redis_streams::RedisStreamsSink::connect(url).await?,
        ));
        #[cfg(not(feature = "redis"))]
        return Err(invalid("this build has no redis feature"));
    }
    if url.starts_with("mqtt://") || url.starts_with("mqtts://") {
        #[cfg(feature = "mqtt")]
        return Ok(Box::new(mqtt::MqttSink::connect(url).await?));
        #[cfg(not(feature = "mqtt"))]
        return Err(invalid("this build has no mqtt feature"));
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        #[cfg(feature = "http")]
        return Ok(Box::new(http::WebhookSink::connect(url).await?));
        #[cfg(not(feature = "http"))]
        return Err(invalid("this build has no http feature"));
    }
    Err(invalid("unknown scheme"))
}
