//! Kafka sink (rdkafka, librdkafka built from source; feature `kafka`).
//!
//! - Topic = outbox topic; record key = outbox key, so per-key order follows partitions.
//! - Producer: `enable.idempotence=true`, `acks=all` (librdkafka's default leaves
//!   idempotence off), `message.timeout.ms` below the relay's lease (default 8 s) so a
//!   delivery report always arrives before the claim could pass to another relay.
//! - Confirmed = a successful delivery report (the partition leader and its in-sync
//!   replicas have the record). Envelope: record headers `message-id`, `topic`, `key`,
//!   `occurred-at` and the stored headers.
//! - Errors: record too large, unknown topic (topics are not created by the relay), topic
//!   authorization failure, invalid record, policy violation → permanent; delivery
//!   timeout, all brokers down, no leader, not enough in-sync replicas, authentication, a
//!   full local queue, a throttling quota → unavailable (the destination, not the
//!   message); anything else → transient.
//!   Error codes: <https://docs.confluent.io/platform/current/clients/librdkafka/html/rdkafka_8h.html>.
//!
//! - With `envelope=cloudevents` ([`crate::cloudevents`], the Kafka binding's binary mode):
//!   record headers `ce_specversion`, `ce_id`, `ce_source`, `ce_type`, `ce_time` and the
//!   other attributes with the `ce_` prefix (UTF-8), `content-type` = `datacontenttype`,
//!   the value = the payload, the record key = the key (also `ce_partitionkey`). With
//!   `envelope=cloudevents-structured`: `content-type: application/cloudevents+json` and
//!   the JSON event as the value. No `message-id`, `topic`, `key` or `occurred-at` headers
//!   then.
//!
//! URL: `kafka://HOST:PORT[,HOST:PORT…][?message_timeout_ms=N][&envelope=…][&ce_source=…]`.

use super::{Confirmations, ErrorKind, PublishError, Sink, SinkError};
use crate::cloudevents::{
    Binding, ENVELOPE_PARAM, EnvelopeFormat, JSON_FORMAT, Mode, SOURCE_PARAM,
};
use crate::message::{OutgoingMessage, header};
use async_trait::async_trait;
use bytes::Bytes;
use futures::future::join_all;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::collections::HashMap;
use std::time::Duration;

/// Publishes to Kafka and waits for each delivery report.
pub struct KafkaSink {
    producer: FutureProducer,
    describe: String,
    envelope: EnvelopeFormat,
}

impl KafkaSink {
    /// Creates the producer for `url`. No connection is made yet: brokers that are down
    /// make publishes report the destination unavailable, they do not fail this call.
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] for a URL without brokers or with a bad option, or a
    /// configuration librdkafka refuses.
    pub async fn connect(url: &str) -> Result<Self, SinkError> {
        let invalid = |reason: String| SinkError::InvalidUrl {
            url: crate::redact::redact_url(url),
            reason: crate::redact::scrub(&reason, url),
        };
        let rest = url
            .strip_prefix("kafka://")
            .ok_or_else(|| invalid("expected kafka://HOST:PORT".into()))?;
        let (servers, query) = rest.split_once('?').unwrap_or((rest, ""));
        let servers = servers.trim_end_matches('/');
        if servers.is_empty() {
            return Err(invalid("no broker given".into()));
        }
        let mut timeout_ms: u64 = 8_000;
        let mut envelope = None;
        let mut source = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let decoded = || {
                url::form_urlencoded::parse(pair.as_bytes())
                    .next()
                    .map(|(_, v)| v.into_owned())
            };
            match pair.split_once('=') {
                Some(("message_timeout_ms", v)) => {
                    timeout_ms = v.parse().map_err(|_| {
                        invalid(format!("message_timeout_ms={v:?} is not a number"))
                    })?;
                }
                Some((ENVELOPE_PARAM, _)) => envelope = decoded(),
                Some((SOURCE_PARAM, _)) => source = decoded(),
                _ => {
                    // The name only: the value of a mistyped option may be a secret.
                    let name = pair.split_once('=').map_or(pair, |(k, _)| k);
                    return Err(invalid(format!(
                        "unknown option {name:?} (known: message_timeout_ms, envelope, ce_source)"
                    )));
                }
            }
        }
        let envelope =
            EnvelopeFormat::parse(Binding::Kafka, "", envelope.as_deref(), source.as_deref())
                .map_err(invalid)?;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", servers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", timeout_ms.to_string())
            .set("linger.ms", "2")
            .create()
            .map_err(|e| invalid(format!("librdkafka refused the configuration: {e}")))?;
        Ok(KafkaSink {
            producer,
            describe: format!("kafka://{servers}{}", envelope.describe()),
            envelope,
        })
    }

    /// `Some(permanent error)` when the cluster answers that `topic` does not exist;
    /// `None` when it exists or the cluster cannot be asked (then the timeout stands).
    async fn topic_missing(&self, topic: &str) -> Option<PublishError> {
        let producer = self.producer.clone();
        let name = topic.to_owned();
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&name), Duration::from_secs(2))
        })
        .await
        .ok()?
        .ok()?;
        let t = metadata.topics().iter().find(|t| t.name() == topic)?;
        match t.error() {
            Some(e) if RDKafkaErrorCode::from(e) == RDKafkaErrorCode::UnknownTopicOrPartition => {
                Some(PublishError::permanent(format!(
                    "Kafka topic {topic:?} does not exist: create it (the relay does not create topics)"
                )).with_code("no_destination"))
            }
            _ if t.partitions().is_empty() => Some(PublishError::permanent(format!(
                "Kafka topic {topic:?} does not exist (no partitions): create it (the relay does not create topics)"
            )).with_code("no_destination")),
            _ => None,
        }
    }

    /// The record headers and value of `m` in this sink's envelope.
    fn encode(&self, m: &OutgoingMessage) -> Result<(OwnedHeaders, Bytes), PublishError> {
        let Some(ce) = self.envelope.cloudevents() else {
            return Ok((Self::headers(m), m.payload.clone()));
        };
        let event = ce.event(m)?;
        let mut h = OwnedHeaders::new_with_capacity(event.attributes.len() + 1);
        let (content_type, value) = match ce.mode() {
            Mode::Binary => {
                for (name, value) in event.binary_headers(Binding::Kafka) {
                    h = h.insert(Header {
                        key: &name,
                        value: Some(value.as_bytes()),
                    });
                }
                (event.datacontenttype.clone(), event.data.clone())
            }
            Mode::Structured => (Some(JSON_FORMAT.to_owned()), Bytes::from(event.to_json())),
        };
        if let Some(ct) = content_type {
            h = h.insert(Header {
                key: header::CONTENT_TYPE,
                value: Some(ct.as_bytes()),
            });
        }
        Ok((h, value))
    }

    fn headers(m: &OutgoingMessage) -> OwnedHeaders {
        let mut h = OwnedHeaders::new_with_capacity(m.headers.len() + 4);
        for (name, value) in m.envelope_headers() {
            h = h.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        h
    }
}

/// Maps a librdkafka error to the relay's classes.
fn classify(e: &KafkaError, topic: &str) -> PublishError {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(C::MessageSizeTooLarge | C::InvalidMessageSize) => PublishError::permanent(format!(
            "record for {topic:?} is larger than the broker accepts: {e}"
        )).with_code("too_large"),
        Some(C::UnknownTopicOrPartition | C::UnknownTopic) => PublishError::permanent(format!(
            "Kafka topic {topic:?} does not exist: create it (the relay does not create topics): {e}"
        )).with_code("no_destination"),
        Some(C::TopicAuthorizationFailed) => {
            PublishError::permanent(format!("not authorised to write to {topic:?}: {e}")).with_code("not_authorized")
        }
        // The broker's record validation or a topic policy refuses this record (Kafka
        // protocol error codes 87 INVALID_RECORD and 44 POLICY_VIOLATION, not retriable).
        Some(C::InvalidRecord | C::PolicyViolation) => {
            PublishError::permanent(format!("Kafka refused the record for {topic:?}: {e}")).with_code("rejected")
        }
        // No delivery report within message.timeout.ms, or the broker did not answer the
        // produce request in time (7): judged by the router like any timeout.
        Some(C::MessageTimedOut) => PublishError::timed_out(format!("Kafka did not confirm: {e}")),
        Some(C::RequestTimedOut) => PublishError::timed_out(format!("Kafka publish: {e}")),
        // The cluster, not the record: no broker reachable, no leader, not enough in-sync
        // replicas (5, 6, 8, 19, 20), authentication; and pressure: the local producer
        // queue is full (queue.buffering.max.messages) or a quota throttles us (89).
        Some(
            C::AllBrokersDown
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::BrokerNotAvailable
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::Authentication
            | C::SaslAuthenticationFailed
            | C::QueueFull
            | C::ThrottlingQuotaExceeded,
        ) => PublishError::unavailable(format!("Kafka cannot take records now: {e}")).with_code("destination_down"),
        _ => PublishError::transient(format!("Kafka publish: {e}")),
    }
}

#[async_trait]
impl Sink for KafkaSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        // Queue every record (pipelined), then await each delivery report.
        let mut pending = Vec::with_capacity(batch.len());
        for m in batch {
            let (headers, value) = match self.encode(m) {
                Ok(encoded) => encoded,
                Err(e) => {
                    pending.push(Err(e));
                    continue;
                }
            };
            let mut record = FutureRecord::<str, [u8]>::to(&m.topic)
                .payload(&value)
                .headers(headers);
            if let Some(k) = &m.key {
                record = record.key(k.as_str());
            }
            pending.push(match self.producer.send_result(record) {
                Ok(delivery) => Ok(delivery),
                Err((e, _)) => Err(classify(&e, &m.topic)),
            });
        }
        let results = join_all(pending.into_iter().zip(batch).enumerate().map(
            |(i, (p, m))| async move {
                let r = match p {
                    Err(e) => Err(e),
                    Ok(delivery) => match delivery.await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err((e, _))) => Err(classify(&e, &m.topic)),
                        Err(_) => Err(PublishError::unavailable("Kafka producer was shut down").with_code("not_connected")),
                    },
                };
                // Confirmations are recorded as they arrive; a possible missing topic is
                // looked up below first.
                if !matches!(&r, Err(e) if matches!(e.kind, ErrorKind::Unavailable | ErrorKind::TimedOut)) {
                    confirm.set(i, r.clone());
                }
                r
            },
        ))
        .await;
        // A record for a topic that does not exist only times out in librdkafka: ask the
        // cluster, so a missing topic is quarantined instead of retried forever.
        let mut checked: HashMap<&str, Option<PublishError>> = HashMap::new();
        for (i, (m, r)) in batch.iter().zip(results).enumerate() {
            if let Err(e) = r
                && matches!(e.kind, ErrorKind::Unavailable | ErrorKind::TimedOut)
            {
                if !checked.contains_key(m.topic.as_str()) {
                    let missing = self.topic_missing(&m.topic).await;
                    checked.insert(m.topic.as_str(), missing);
                }
                confirm.set(i, Err(checked[m.topic.as_str()].clone().unwrap_or(e)));
            }
        }
    }

    async fn close(&self) {
        let producer = self.producer.clone();
        let _ = tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(5))).await;
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}
