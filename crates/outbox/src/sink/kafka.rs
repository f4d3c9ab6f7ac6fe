//! Kafka sink (rdkafka, librdkafka built from source; feature `kafka`).
//!
//! - Topic = outbox topic; record key = outbox key, so per-key order follows partitions.
//! - Topics Kafka would not take as they are, refused permanently before the record is
//!   queued (no byte reaches a broker, whether or not one is up): a topic starting with
//!   `__` is an internal topic (`__consumer_offsets`, `__transaction_state`,
//!   `__cluster_metadata`, `__share_group_state`: consumer-group offsets, transactions,
//!   the KRaft metadata log), refused with the code [`CONTROL_TOPIC`](super::CONTROL_TOPIC)
//!   so no producer can forge offsets or transaction markers with the relay's
//!   credentials; a topic outside Kafka's legal names, `[a-zA-Z0-9._-]`, at most 249
//!   characters, neither `.` nor `..`, is `invalid_topic` (the broker would answer
//!   `INVALID_TOPIC_EXCEPTION`, 17). Both rules are Kafka's `Topic` class
//!   (<https://github.com/apache/kafka/blob/trunk/clients/src/main/java/org/apache/kafka/common/internals/Topic.java>).
//!   The record's topic is the outbox topic unchanged (no prefix), so the rules apply to
//!   it as it is.
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
//! URL: `kafka://[USER[:PASS]@]HOST:PORT[,HOST:PORT…][?message_timeout_ms=N]…` (plain
//! text; `SASL_PLAINTEXT` with a user) or `kafkas://…` (TLS: `SSL`, or `SASL_SSL` with a
//! user). Parameters:
//! - `message_timeout_ms=N`: librdkafka's `message.timeout.ms` (default 8,000);
//! - `sasl_mechanism=PLAIN|SCRAM-SHA-256|SCRAM-SHA-512` (default `PLAIN` when a user is
//!   given): `sasl.mechanism`, with the user and password as `sasl.username` /
//!   `sasl.password`; `password_file=PATH` reads the password from a file;
//! - `ca=PATH`: `ssl.ca.location` (librdkafka then trusts that bundle instead of the
//!   system's; default `OUTBOX_TLS_CA_FILE`); `cert=PATH&key=PATH`:
//!   `ssl.certificate.location` / `ssl.key.location` (mutual TLS);
//! - `security_protocol=…`: overrides what the scheme and the user imply;
//! - `envelope=cloudevents|cloudevents-structured`, `ce_source=URI`: see above;
//! - `kafka.NAME=VALUE`: any other librdkafka producer property
//!   (<https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md>), except
//!   the ones this sink owns (`bootstrap.servers`, `enable.idempotence`, `acks`,
//!   `message.timeout.ms`) and the ones the URL's settings decide (`security.protocol`,
//!   `sasl.*` credentials and mechanism, `ssl.*.location`), which are refused.

use super::{Confirmations, ErrorKind, PublishCode, PublishError, Sink, SinkError};
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

impl std::fmt::Debug for KafkaSink {
    /// The description only, as logs show it: no credentials (see [`Sink::describe`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("KafkaSink").field(&self.describe()).finish()
    }
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
        let settings = parse_url(url).map_err(invalid)?;
        let envelope = EnvelopeFormat::parse(
            Binding::Kafka,
            "",
            settings.envelope.as_deref(),
            settings.source.as_deref(),
        )
        .map_err(invalid)?;
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &settings.servers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", settings.timeout_ms.to_string())
            .set("linger.ms", "2");
        for (k, v) in &settings.properties {
            config.set(k, v);
        }
        let producer: FutureProducer = config
            .create()
            .map_err(|e| invalid(format!("librdkafka refused the configuration: {e}")))?;
        Ok(KafkaSink {
            producer,
            describe: format!(
                "{}://{}{}",
                settings.scheme,
                settings.servers,
                envelope.describe()
            ),
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
                )).with_code(PublishCode::NoDestination))
            }
            _ if t.partitions().is_empty() => Some(PublishError::permanent(format!(
                "Kafka topic {topic:?} does not exist (no partitions): create it (the relay does not create topics)"
            )).with_code(PublishCode::NoDestination)),
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

/// What a Kafka URL says.
#[derive(Debug, PartialEq)]
struct KafkaUrl {
    scheme: &'static str,
    servers: String,
    timeout_ms: u64,
    /// `envelope=` and `ce_source=`, as given.
    envelope: Option<String>,
    source: Option<String>,
    /// librdkafka properties besides the ones the sink always sets.
    properties: Vec<(String, String)>,
}

/// The librdkafka properties this sink sets itself.
const OWNED: [&str; 4] = [
    "bootstrap.servers",
    "enable.idempotence",
    "acks",
    "message.timeout.ms",
];

/// The librdkafka properties the URL's own settings decide (the sink sets them after the
/// `kafka.` ones, so a `kafka.` value would be silently replaced), and what to use instead.
const URL_OWNED: [(&str, &str); 7] = [
    ("security.protocol", "security_protocol="),
    ("sasl.mechanism", "sasl_mechanism="),
    ("sasl.username", "the URL's USER@"),
    ("sasl.password", "the URL's USER:PASS@ or password_file="),
    ("ssl.ca.location", "ca="),
    ("ssl.certificate.location", "cert="),
    ("ssl.key.location", "key="),
];

fn parse_url(url: &str) -> Result<KafkaUrl, String> {
    let (scheme, rest) = if let Some(r) = url.strip_prefix("kafka://") {
        ("kafka", r)
    } else if let Some(r) = url.strip_prefix("kafkas://") {
        ("kafkas", r)
    } else {
        return Err("expected kafka://HOST:PORT or kafkas://HOST:PORT".into());
    };
    let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (userinfo, servers) = match authority.rsplit_once('@') {
        Some((u, s)) => (Some(u), s),
        None => (None, authority),
    };
    let servers = servers.trim_end_matches('/');
    if servers.is_empty() {
        return Err("no broker given".into());
    }
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| "the URL's user or password is not UTF-8 once percent-decoded".to_owned())
    };
    let (mut user, mut password) = (None, None);
    if let Some(u) = userinfo {
        match u.split_once(':') {
            Some((name, pass)) => {
                user = Some(decode(name)?);
                password = Some(decode(pass)?);
            }
            None => user = Some(decode(u)?),
        }
    }
    let mut timeout_ms: u64 = 8_000;
    let (mut envelope, mut source) = (None, None);
    let mut mechanism = None;
    let mut protocol = None;
    let mut files = super::tls::TlsFiles::default();
    let mut properties = Vec::new();
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            "message_timeout_ms" => {
                timeout_ms = v
                    .parse()
                    .map_err(|_| format!("message_timeout_ms={v:?} is not a number"))?;
            }
            ENVELOPE_PARAM => envelope = Some(v.into_owned()),
            SOURCE_PARAM => source = Some(v.into_owned()),
            "sasl_mechanism" => mechanism = Some(v.into_owned()),
            "security_protocol" => protocol = Some(v.into_owned()),
            "ca" => files.ca = Some(v.into_owned().into()),
            "cert" => files.cert = Some(v.into_owned().into()),
            "key" => files.key = Some(v.into_owned().into()),
            "password_file" => {
                password = Some(
                    super::tls::read_secret("password_file", std::path::Path::new(v.as_ref()))
                        .map_err(|e| e.to_string())?,
                );
            }
            name => match name.strip_prefix("kafka.") {
                Some(prop) if OWNED.contains(&prop) => {
                    return Err(format!(
                        "kafka.{prop} is set by the sink and cannot be changed"
                    ));
                }
                Some(prop)
                    if let Some((_, instead)) = URL_OWNED.iter().find(|(p, _)| *p == prop) =>
                {
                    return Err(format!(
                        "kafka.{prop} comes from the URL's own settings: use {instead}"
                    ));
                }
                Some(prop) if !prop.is_empty() => {
                    properties.push((prop.to_owned(), v.into_owned()));
                }
                // The name only: the value of a mistyped option may be a secret.
                _ => return Err(format!("unknown option {name:?}")),
            },
        }
    }
    if files.ca.is_none() {
        files.ca = super::tls::default_ca();
    }
    if files.cert.is_some() != files.key.is_some() {
        return Err("cert= and key= go together: give both or neither".into());
    }
    let tls = scheme == "kafkas";
    let protocol = protocol.unwrap_or_else(|| {
        match (tls, user.is_some()) {
            (false, false) => "PLAINTEXT",
            (false, true) => "SASL_PLAINTEXT",
            (true, false) => "SSL",
            (true, true) => "SASL_SSL",
        }
        .to_owned()
    });
    let mut set = |k: &str, v: String| properties.push((k.to_owned(), v));
    set("security.protocol", protocol.clone());
    if let Some(u) = user {
        set(
            "sasl.mechanism",
            mechanism.unwrap_or_else(|| "PLAIN".into()),
        );
        set("sasl.username", u);
        set("sasl.password", password.unwrap_or_default());
    } else if mechanism.is_some() {
        return Err("sasl_mechanism needs a user (kafka://USER:PASS@HOST…)".into());
    }
    // librdkafka reads the protocol's name in any case.
    if protocol.to_ascii_uppercase().contains("SSL") {
        for (what, path) in [
            ("ca", &files.ca),
            ("cert", &files.cert),
            ("key", &files.key),
        ] {
            if let Some(p) = path
                && let Err(e) = std::fs::metadata(p)
            {
                return Err(format!("cannot read {what} file {p:?}: {e}"));
            }
        }
        if let Some(ca) = &files.ca {
            set("ssl.ca.location", ca.display().to_string());
        }
        if let (Some(cert), Some(key)) = (&files.cert, &files.key) {
            set("ssl.certificate.location", cert.display().to_string());
            set("ssl.key.location", key.display().to_string());
        }
    } else if files.named() {
        return Err("ca, cert and key need kafkas:// (or security_protocol=SSL / SASL_SSL)".into());
    }
    Ok(KafkaUrl {
        scheme,
        servers: servers.to_owned(),
        timeout_ms,
        envelope,
        source,
        properties,
    })
}

/// Maps a librdkafka error to the relay's classes.
fn classify(e: &KafkaError, topic: &str) -> PublishError {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(C::MessageSizeTooLarge | C::InvalidMessageSize) => PublishError::permanent(format!(
            "record for {topic:?} is larger than the broker accepts: {e}"
        )).with_code(PublishCode::TooLarge),
        Some(C::UnknownTopicOrPartition | C::UnknownTopic) => PublishError::permanent(format!(
            "Kafka topic {topic:?} does not exist: create it (the relay does not create topics): {e}"
        )).with_code(PublishCode::NoDestination),
        Some(C::TopicAuthorizationFailed) => {
            PublishError::permanent(format!("not authorised to write to {topic:?}: {e}")).with_code(PublishCode::NotAuthorized)
        }
        // The broker's record validation or a topic policy refuses this record (Kafka
        // protocol error codes 87 INVALID_RECORD and 44 POLICY_VIOLATION, not retriable).
        Some(C::InvalidRecord | C::PolicyViolation) => {
            PublishError::permanent(format!("Kafka refused the record for {topic:?}: {e}")).with_code(PublishCode::Rejected)
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
        ) => PublishError::unavailable(format!("Kafka cannot take records now: {e}")).with_code(PublishCode::DestinationDown),
        _ => PublishError::transient(format!("Kafka publish: {e}")),
    }
}

/// Longest Kafka topic name (`Topic.MAX_NAME_LENGTH`).
const MAX_TOPIC_CHARS: usize = 249;

/// Why Kafka must not be sent `topic`, as a permanent error, if it must not: an internal
/// (`__`) topic is [`CONTROL_TOPIC`](super::CONTROL_TOPIC); a name outside
/// `[a-zA-Z0-9._-]{1,249}`, or `.` / `..`, is `invalid_topic` (see the module docs).
fn topic_refusal(topic: &str) -> Option<PublishError> {
    if topic.starts_with("__") {
        return Some(PublishError::control_topic(
            topic,
            "Kafka topics starting with __ are the cluster's internal topics (__consumer_offsets, __transaction_state, __cluster_metadata, …)",
        ));
    }
    let why = if topic.is_empty() || topic == "." || topic == ".." {
        "Kafka topic names cannot be empty, \".\" or \"..\""
    } else if topic.len() > MAX_TOPIC_CHARS {
        "Kafka topic names have at most 249 characters"
    } else if !topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        "Kafka topic names are made of ASCII letters, digits, '.', '_' and '-'"
    } else {
        return None;
    };
    Some(
        PublishError::permanent(format!("topic {topic:?} is not a valid Kafka topic: {why}"))
            .with_code(PublishCode::InvalidTopic),
    )
}

#[async_trait]
impl Sink for KafkaSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        // Queue every record (pipelined), then await each delivery report.
        let mut pending = Vec::with_capacity(batch.len());
        for m in batch {
            if let Some(e) = topic_refusal(&m.topic) {
                pending.push(Err(e));
                continue;
            }
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
                        Err(_) => Err(PublishError::unavailable("Kafka producer was shut down").with_code(PublishCode::NotConnected)),
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn props(url: &str) -> HashMap<String, String> {
        parse_url(url).unwrap().properties.into_iter().collect()
    }

    #[test]
    fn internal_and_illegal_topics_are_refused() {
        for ok in [
            "orders",
            "orders.placed.v1",
            "a_b-c.D9",
            "_schemas",
            &"t".repeat(249),
        ] {
            assert!(topic_refusal(ok).is_none(), "{ok}");
        }
        for internal in [
            "__consumer_offsets",
            "__transaction_state",
            "__cluster_metadata",
            "__x",
        ] {
            let e = topic_refusal(internal).unwrap();
            assert_eq!(
                (e.kind, e.code),
                (ErrorKind::Permanent, PublishCode::ControlTopic),
                "{e}"
            );
            assert!(e.message.contains(internal), "{e}");
        }
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "a b",
            "a$b",
            "a:b",
            "grüße",
            &"t".repeat(250),
        ] {
            let e = topic_refusal(bad).unwrap();
            assert_eq!(
                (e.kind, e.code),
                (ErrorKind::Permanent, PublishCode::InvalidTopic),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn the_scheme_and_the_user_choose_the_security_protocol() {
        let p = props("kafka://b1:9092,b2:9092");
        assert_eq!(p["security.protocol"], "PLAINTEXT");
        assert!(!p.contains_key("sasl.username"));
        let p = props("kafka://app:s%40cret@b1:9092?sasl_mechanism=SCRAM-SHA-512");
        assert_eq!(p["security.protocol"], "SASL_PLAINTEXT");
        assert_eq!(p["sasl.mechanism"], "SCRAM-SHA-512");
        assert_eq!(p["sasl.username"], "app");
        assert_eq!(p["sasl.password"], "s@cret");
        let ca = tempfile::NamedTempFile::new().unwrap();
        let p = props(&format!("kafkas://b1:9093?ca={}", ca.path().display()));
        assert_eq!(p["security.protocol"], "SSL");
        assert_eq!(p["ssl.ca.location"], ca.path().display().to_string());
        let p = props("kafkas://app:pw@b1:9093?kafka.client.id=relay-1");
        assert_eq!(p["security.protocol"], "SASL_SSL");
        assert_eq!(p["sasl.mechanism"], "PLAIN");
        assert_eq!(p["client.id"], "relay-1");
        let u = parse_url("kafka://b1:9092,b2:9092/?message_timeout_ms=5000").unwrap();
        assert_eq!(u.servers, "b1:9092,b2:9092");
        assert_eq!(u.timeout_ms, 5000);
    }

    #[test]
    fn tls_settings_are_not_lost() {
        let ca = tempfile::NamedTempFile::new().unwrap();
        // librdkafka reads security.protocol in any case: the CA still applies.
        let p = props(&format!(
            "kafka://b1:9093?security_protocol=ssl&ca={}",
            ca.path().display()
        ));
        assert_eq!(p["ssl.ca.location"], ca.path().display().to_string());
        // A property the URL's own settings decide cannot be given a second way, where
        // the sink's value would silently replace it (kafka.security.protocol=SSL on a
        // kafka:// URL would have stayed PLAINTEXT).
        for (param, hint) in [
            ("kafka.security.protocol=SSL", "security_protocol"),
            ("kafka.sasl.mechanism=PLAIN", "sasl_mechanism"),
            ("kafka.sasl.username=u", "USER"),
            ("kafka.sasl.password=p", "password_file"),
            ("kafka.ssl.ca.location=/x", "ca="),
            ("kafka.ssl.certificate.location=/x", "cert="),
            ("kafka.ssl.key.location=/x", "key="),
        ] {
            let e = parse_url(&format!("kafka://b:1?{param}")).unwrap_err();
            assert!(e.contains(hint), "{param}: {e}");
        }
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        let e = parse_url("kafka://b:1?kafka.acks=0").unwrap_err();
        assert!(e.contains("kafka.acks is set by the sink"), "{e}");
        let e = parse_url("kafka://b:1?sasl.password=x").unwrap_err();
        assert!(e.contains("unknown option \"sasl.password\""), "{e}");
        let e = parse_url("kafka://b:1?ca=/etc/ca.pem").unwrap_err();
        assert!(e.contains("need kafkas://"), "{e}");
        let e = parse_url("kafkas://b:1?cert=/etc/c.pem").unwrap_err();
        assert!(e.contains("go together"), "{e}");
        let e = parse_url("kafka://b:1?sasl_mechanism=PLAIN").unwrap_err();
        assert!(e.contains("needs a user"), "{e}");
        let e = parse_url("kafkas://b:1?ca=/nonexistent/ca.pem").unwrap_err();
        assert!(e.contains("cannot read ca file"), "{e}");
    }
}
