//! The messages themselves: what a producer enqueues ([`Message`], its builder, and the
//! typed [`Contract`] path), what a relay publishes ([`OutgoingMessage`]), what a consumer
//! reads back ([`Envelope`], [`EnvelopeError`]), and the ids of follow-ups
//! ([`follow_up_id`]).
//!
//! Vocabulary: no IO; imports only [`crate::error`].

use crate::error::Error;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::Serialize;
use std::collections::BTreeMap;
use uuid::Uuid;

/// Header names the envelope reserves; they are stored among the headers and sent by every
/// sink. A user header with one of these names is refused at enqueue.
pub mod header {
    /// Correlation id: the request or saga this message belongs to.
    pub const CORRELATION_ID: &str = "correlation-id";
    /// Causation id: the message id of the message that caused this one.
    pub const CAUSATION_ID: &str = "causation-id";
    /// W3C Trace Context `traceparent` (<https://www.w3.org/TR/trace-context/>).
    pub const TRACEPARENT: &str = "traceparent";
    /// W3C Trace Context `tracestate`.
    pub const TRACESTATE: &str = "tracestate";
    /// Media type of the payload, e.g. `application/json`.
    pub const CONTENT_TYPE: &str = "content-type";
    /// The message id (set by sinks from the row, never stored as a header).
    pub const MESSAGE_ID: &str = "message-id";
    /// The topic (set by sinks from the row).
    pub const TOPIC: &str = "topic";
    /// The key (set by sinks from the row when present).
    pub const KEY: &str = "key";
    /// When the producer enqueued the message, RFC 3339 (set by sinks from the row).
    pub const OCCURRED_AT: &str = "occurred-at";

    /// Names a producer may not set through [`super::Message::header`]: they come from the
    /// row itself.
    pub const RESERVED: [&str; 4] = [MESSAGE_ID, TOPIC, KEY, OCCURRED_AT];
}

/// Longest topic accepted, in bytes.
pub const MAX_TOPIC_BYTES: usize = 255;

/// One publication intent: envelope + opaque payload bytes. Its `Debug` shows the
/// payload's length, never its bytes, so a message in a log line or a panic leaks nothing.
///
/// Build it with [`Message::new`] (bytes) or [`Message::json`] (serde), then enqueue it with
/// the store's `enqueue` inside your own transaction.
///
/// ```
/// use outbox::Message;
/// let msg = Message::new("orders.order-placed.v1", br#"{"order":42}"#.to_vec())
///     .key("order-42")
///     .header("tenant", "acme")
///     .correlation_id("req-7");
/// assert_eq!(msg.topic(), "orders.order-placed.v1");
/// ```
#[derive(Clone)]
pub struct Message {
    pub(crate) message_id: Uuid,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    pub(crate) payload: Bytes,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) available_at: Option<DateTime<Utc>>,
    pub(crate) delay: std::time::Duration,
}

impl Message {
    /// A message on `topic` carrying `payload` (opaque bytes; never logged). The message id
    /// is a fresh UUIDv7 unless [`Message::message_id`] sets one.
    pub fn new(topic: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Message {
            message_id: Uuid::now_v7(),
            topic: topic.into(),
            key: None,
            payload: payload.into(),
            headers: BTreeMap::new(),
            available_at: None,
            delay: std::time::Duration::ZERO,
        }
    }

    /// A message whose payload is `value` as JSON, with `content-type: application/json`.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] when `value` cannot be serialized.
    pub fn json<T: Serialize + ?Sized>(topic: impl Into<String>, value: &T) -> Result<Self, Error> {
        let payload = serde_json::to_vec(value)
            .map_err(|e| Error::InvalidMessage(format!("payload is not serializable: {e}")))?;
        Ok(Message::new(topic, payload).header(header::CONTENT_TYPE, "application/json"))
    }

    /// A message for a typed [`Contract`]: topic from [`Contract::TOPIC`], JSON payload.
    ///
    /// # Errors
    /// As [`Message::json`].
    pub fn from_contract<C: Contract>(value: &C) -> Result<Self, Error> {
        Message::json(C::TOPIC, value)
    }

    /// Sets the message id. Use a stable id (derived from the business operation) to make a
    /// retried producer idempotent: enqueue returns the existing row instead of a second one.
    pub fn message_id(mut self, id: Uuid) -> Self {
        self.message_id = id;
        self
    }

    /// Sets the ordering / partition key (usually the aggregate id).
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a user header (text). Names in [`header::RESERVED`] are refused at enqueue.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets the correlation id header.
    pub fn correlation_id(self, id: impl Into<String>) -> Self {
        self.header(header::CORRELATION_ID, id)
    }

    /// Sets the causation id header (usually the message id of the message being handled).
    pub fn causation_id(self, id: impl Into<String>) -> Self {
        self.header(header::CAUSATION_ID, id)
    }

    /// Sets W3C trace context headers (`traceparent`, optional `tracestate`).
    pub fn trace_context(self, traceparent: impl Into<String>, tracestate: Option<String>) -> Self {
        let m = self.header(header::TRACEPARENT, traceparent);
        match tracestate {
            Some(s) => m.header(header::TRACESTATE, s),
            None => m,
        }
    }

    /// Delays delivery until the absolute time `at` (UTC). The relay compares it with the
    /// database clock, so a producer whose clock is off shifts the delivery time by its
    /// error: prefer [`Message::delay`] unless the time comes from the database or a user.
    pub fn available_at(mut self, at: DateTime<Utc>) -> Self {
        self.available_at = Some(at);
        self
    }

    /// Delays delivery by `delay` after the enqueue, measured on the database clock (the
    /// producer's clock plays no part). Ignored when [`Message::available_at`] is set.
    pub fn delay(mut self, delay: std::time::Duration) -> Self {
        self.delay = delay;
        self
    }

    pub(crate) fn delay_ms(&self) -> i64 {
        i64::try_from(self.delay.as_millis()).unwrap_or(i64::MAX)
    }

    /// The message id.
    pub fn id(&self) -> Uuid {
        self.message_id
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Bytes counted against the size limit: payload + topic + key + header names and
    /// values.
    pub fn size(&self) -> usize {
        message_size(
            &self.payload,
            &self.topic,
            self.key.as_deref(),
            &self.headers,
        )
    }

    /// Checks everything a store needs before writing: topic shape, no NUL in text fields
    /// (PostgreSQL text and jsonb cannot hold it), reserved header names, the size limit.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] or [`Error::MessageTooLarge`].
    pub fn validate(&self, max_message_bytes: usize) -> Result<(), Error> {
        let t = &self.topic;
        if t.is_empty() || t.len() > MAX_TOPIC_BYTES {
            return Err(Error::InvalidMessage(format!(
                "topic must be 1-{MAX_TOPIC_BYTES} bytes, got {}",
                t.len()
            )));
        }
        if t.chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '*' || c == '>')
        {
            return Err(Error::InvalidMessage(format!(
                "topic {t:?} contains whitespace, control characters or a wildcard (* or >)"
            )));
        }
        if self.key.as_deref().is_some_and(|k| k.contains('\0')) {
            return Err(Error::InvalidMessage("key contains a NUL character".into()));
        }
        for (name, value) in &self.headers {
            if !is_header_name(name) {
                return Err(Error::InvalidMessage(format!(
                    "header name {name:?} must be 1-255 characters of A-Z a-z 0-9 and !#$%&'*+-.^_`|~ (an HTTP token, which every broker carries)"
                )));
            }
            if value.contains('\0') {
                return Err(Error::InvalidMessage(format!(
                    "header {name:?}: the value must not contain NUL"
                )));
            }
            if header::RESERVED.contains(&name.as_str()) {
                return Err(Error::InvalidMessage(format!(
                    "header {name:?} is reserved: it is set from the message itself"
                )));
            }
        }
        let size = self.size();
        if size > max_message_bytes {
            return Err(Error::MessageTooLarge {
                size,
                limit: max_message_bytes,
            });
        }
        Ok(())
    }

    pub(crate) fn headers_json(&self) -> serde_json::Value {
        serde_json::Value::Object(
            self.headers
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect(),
        )
    }
}

/// An RFC 9110 token (section 5.6.2), at most 255 bytes: what HTTP, Kafka, AMQP, NATS and
/// MQTT all accept as a header or property name.
pub fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A typed message contract: a versioned topic name and a serde payload, so services enqueue
/// `OrderPlacedV1 { .. }` instead of spelling strings.
///
/// ```
/// use outbox::{Contract, Message};
/// #[derive(serde::Serialize)]
/// struct OrderPlacedV1 { order_id: u64 }
/// impl Contract for OrderPlacedV1 { const TOPIC: &'static str = "orders.order-placed.v1"; }
/// let msg = Message::from_contract(&OrderPlacedV1 { order_id: 7 }).unwrap();
/// assert_eq!(msg.topic(), "orders.order-placed.v1");
/// ```
pub trait Contract: Serialize {
    /// The versioned topic, e.g. `orders.order-placed.v1`. Change the version when the
    /// payload changes incompatibly; never derive it from a Rust type name.
    const TOPIC: &'static str;
}

/// What enqueue returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// Primary key of the row (claim order).
    pub id: i64,
    /// The message id.
    pub message_id: Uuid,
    /// False when a row with this message id already existed and was returned instead.
    pub inserted: bool,
}

/// A claimed message as the relay hands it to a sink: the envelope and the payload.
/// Its `Debug` shows the payload's length, never its bytes.
#[derive(Clone)]
pub struct OutgoingMessage {
    /// Primary key of the row.
    pub id: i64,
    /// The message id (stable across retries; the consumer's deduplication key).
    pub message_id: Uuid,
    /// The topic.
    pub topic: String,
    /// The ordering / partition key.
    pub key: Option<String>,
    /// Opaque payload bytes.
    pub payload: Bytes,
    /// User and envelope headers (correlation id, trace context, content type, …).
    pub headers: BTreeMap<String, String>,
    /// When the producer enqueued it (database clock).
    pub occurred_at: DateTime<Utc>,
    /// Attempts so far, this one included.
    pub attempts: i32,
}

impl OutgoingMessage {
    /// The full envelope as header pairs: message id, topic, key, occurred-at (RFC 3339),
    /// then the stored headers. Sinks that carry headers send exactly these.
    pub fn envelope_headers(&self) -> Vec<(&str, String)> {
        let mut out = Vec::with_capacity(self.headers.len() + 4);
        out.push((header::MESSAGE_ID, self.message_id.to_string()));
        out.push((header::TOPIC, self.topic.clone()));
        if let Some(k) = &self.key {
            out.push((header::KEY, k.clone()));
        }
        out.push((
            header::OCCURRED_AT,
            self.occurred_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        ));
        // Stored headers never override the envelope (a row written by hand could carry
        // a `message-id` header; consumers deduplicate on the real one).
        for (k, v) in &self.headers {
            if !header::RESERVED.contains(&k.as_str()) {
                out.push((k.as_str(), v.clone()));
            }
        }
        out
    }

    /// Bytes of payload + topic + key + headers (what a broker's size limit counts, roughly).
    pub fn size(&self) -> usize {
        message_size(
            &self.payload,
            &self.topic,
            self.key.as_deref(),
            &self.headers,
        )
    }
}

/// Payload + topic + key + header names and values, in bytes: the one size rule enqueue
/// limits and sinks' size checks share.
fn message_size(
    payload: &[u8],
    topic: &str,
    key: Option<&str>,
    headers: &BTreeMap<String, String>,
) -> usize {
    payload.len()
        + topic.len()
        + key.map_or(0, str::len)
        + headers
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
}

/// At most 64 characters of `v`: how much of a field's value an [`EnvelopeError`] quotes.
pub(crate) fn snippet(v: &str) -> String {
    v.chars().take(64).collect()
}

/// One delivered message as its consumer sees it: the row's fields, its stored headers and
/// the payload. Its `Debug` shows the payload's length, never its bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The stable message id: the consumer's deduplication key.
    pub message_id: Uuid,
    /// The topic the producer enqueued on.
    pub topic: String,
    /// The ordering / partition key, when the producer set one.
    pub key: Option<String>,
    /// When the producer enqueued the message (UTC, microseconds).
    pub occurred_at: DateTime<Utc>,
    /// The stored headers: [`header::CORRELATION_ID`], [`header::CAUSATION_ID`],
    /// [`header::TRACEPARENT`], [`header::TRACESTATE`], [`header::CONTENT_TYPE`] and the
    /// user's own, by name. Never the four row fields above, nor what the transport adds
    /// (`Nats-Msg-Id`, HTTP's own headers).
    pub headers: BTreeMap<String, String>,
    /// The payload, unchanged.
    pub payload: Bytes,
}

impl std::fmt::Debug for Envelope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Envelope")
            .field("message_id", &self.message_id)
            .field("topic", &self.topic)
            .field("key", &self.key)
            .field("occurred_at", &self.occurred_at)
            .field("headers", &self.headers)
            .field("payload", &format_args!("<{} bytes>", self.payload.len()))
            .finish()
    }
}

impl Envelope {
    /// A stored header by exact name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The correlation id header.
    pub fn correlation_id(&self) -> Option<&str> {
        self.header(header::CORRELATION_ID)
    }

    /// The causation id header (the id of the message that caused this one).
    pub fn causation_id(&self) -> Option<&str> {
        self.header(header::CAUSATION_ID)
    }

    /// The W3C `traceparent` header.
    pub fn traceparent(&self) -> Option<&str> {
        self.header(header::TRACEPARENT)
    }

    /// The W3C `tracestate` header.
    pub fn tracestate(&self) -> Option<&str> {
        self.header(header::TRACESTATE)
    }

    /// The payload's media type (the `content-type` header).
    pub fn content_type(&self) -> Option<&str> {
        self.header(header::CONTENT_TYPE)
    }

    /// The message id of this message's follow-up `name` ([`follow_up_id`]): the same on
    /// every redelivery, so an enqueue in the handler's transaction keeps one copy however
    /// often the message is handled.
    pub fn follow_up_id(&self, name: &str) -> Uuid {
        follow_up_id(self.message_id, name)
    }

    /// The envelope headers as a sink writes them (`message-id`, `topic`, `key` when set,
    /// `occurred-at` in RFC 3339 with microseconds, then the stored headers), by name.
    pub fn wire_headers(&self) -> BTreeMap<String, String> {
        let mut out = self.headers.clone();
        out.insert(header::MESSAGE_ID.into(), self.message_id.to_string());
        out.insert(header::TOPIC.into(), self.topic.clone());
        if let Some(k) = &self.key {
            out.insert(header::KEY.into(), k.clone());
        }
        out.insert(
            header::OCCURRED_AT.into(),
            self.occurred_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        );
        out
    }
}

/// Why a delivery could not be read as an [`Envelope`]. Never holds the payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// A required field (`message-id`, `topic`, `occurred-at`) is absent: the message was
    /// not written by an outbox sink.
    #[error("the envelope has no {0} field: not a message an outbox sink wrote")]
    Missing(&'static str),
    /// A field is present but not what the envelope puts there.
    #[error("the envelope field {field:?} is invalid ({reason}): {value:?}")]
    Invalid {
        /// The field or header name.
        field: String,
        /// At most 64 characters of its value.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A header value that is not UTF-8 text (every envelope value is).
    #[error("the envelope header {0:?} is not UTF-8 text")]
    NotUtf8(String),
    /// A name that appears twice (a sink writes each once).
    #[error("the envelope header {0:?} appears more than once")]
    Repeated(String),
    /// The delivery itself is not in the sink's shape (a JSON line that does not parse, a
    /// stream field of the wrong type).
    #[error("not an outbox envelope: {0}")]
    Malformed(String),
}

/// The namespace of [`follow_up_id`] (UUIDv5, RFC 9562 section 5.5):
/// `0110e2f0-e62f-4b1c-adc5-98355884330d`, chosen at random once for this library and
/// fixed forever: changing it would change every follow-up id, so a message redelivered
/// across an upgrade would enqueue its follow-ups twice.
pub const FOLLOW_UP_NAMESPACE: Uuid = Uuid::from_u128(0x0110e2f0_e62f_4b1c_adc5_98355884330d);

/// The message id of the follow-up `name` of the incoming message `incoming`: UUIDv5 in
/// [`FOLLOW_UP_NAMESPACE`] over the 16 bytes of `incoming` followed by the UTF-8 bytes
/// of `name`. The same incoming message and name always give the same id, on every
/// machine and in every version, so handling a redelivered message enqueues follow-ups
/// with the ids the first handling used, and enqueue (idempotent on the message id) keeps
/// one of each. Use a distinct `name` per follow-up of one message (for example the
/// topic, or `"topic/line-3"` when one message fans out).
///
/// ```
/// use outbox::inbox::follow_up_id;
/// use uuid::Uuid;
/// let incoming = Uuid::parse_str("0190c4a8-0000-7000-8000-000000000001").unwrap();
/// assert_eq!(
///     follow_up_id(incoming, "billing.invoice-requested.v1"),
///     follow_up_id(incoming, "billing.invoice-requested.v1"),
/// );
/// assert_ne!(follow_up_id(incoming, "a"), follow_up_id(incoming, "b"));
/// ```
pub fn follow_up_id(incoming: Uuid, name: &str) -> Uuid {
    let mut data = Vec::with_capacity(16 + name.len());
    data.extend_from_slice(incoming.as_bytes());
    data.extend_from_slice(name.as_bytes());
    Uuid::new_v5(&FOLLOW_UP_NAMESPACE, &data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_rejects_bad_input_with_reasons() {
        let ok = Message::new("a.b.v1", vec![1, 2, 3]);
        assert!(ok.validate(1024).is_ok());
        assert!(matches!(
            Message::new("", vec![]).validate(1024),
            Err(Error::InvalidMessage(_))
        ));
        assert!(matches!(
            Message::new("a b", vec![]).validate(1024),
            Err(Error::InvalidMessage(_))
        ));
        assert!(matches!(
            Message::new("t", vec![])
                .header("topic", "x")
                .validate(1024),
            Err(Error::InvalidMessage(_))
        ));
        assert!(matches!(
            Message::new("t", vec![]).header("h", "a\0b").validate(1024),
            Err(Error::InvalidMessage(_))
        ));
        let big = Message::new("t", vec![0u8; 1000]).header("h", "x".repeat(30));
        match big.validate(1024) {
            Err(Error::MessageTooLarge { size, limit }) => {
                assert_eq!(size, 1000 + 1 + 1 + 30);
                assert_eq!(limit, 1024);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn message_ids_are_v7_and_unique() {
        let a = Message::new("t", vec![]);
        let b = Message::new("t", vec![]);
        assert_ne!(a.id(), b.id());
        assert_eq!(a.id().get_version_num(), 7);
    }
}

/// Stands in for a payload in `Debug` output: its length only.
struct Redacted(usize);

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<{} bytes>", self.0)
    }
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Message")
            .field("message_id", &self.message_id)
            .field("topic", &self.topic)
            .field("key", &self.key)
            .field("payload", &Redacted(self.payload.len()))
            .field("headers", &self.headers)
            .field("available_at", &self.available_at)
            .field("delay", &self.delay)
            .finish()
    }
}

impl std::fmt::Debug for OutgoingMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutgoingMessage")
            .field("id", &self.id)
            .field("message_id", &self.message_id)
            .field("topic", &self.topic)
            .field("key", &self.key)
            .field("payload", &Redacted(self.payload.len()))
            .field("headers", &self.headers)
            .field("occurred_at", &self.occurred_at)
            .field("attempts", &self.attempts)
            .finish()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod debug_tests {
    use super::*;

    #[test]
    fn debug_output_never_holds_the_payload() {
        let m = Message::new("t", b"SECRET-PAYLOAD".to_vec()).header("h", "v");
        let shown = format!("{m:?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(shown.contains("<14 bytes>"), "{shown}");
        let o = OutgoingMessage {
            id: 1,
            message_id: m.id(),
            topic: "t".into(),
            key: None,
            payload: Bytes::from_static(b"SECRET-PAYLOAD"),
            headers: BTreeMap::new(),
            occurred_at: Utc::now(),
            attempts: 1,
        };
        let shown = format!("{o:?} {o:#?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        let e = Envelope {
            message_id: o.message_id,
            topic: o.topic.clone(),
            key: None,
            occurred_at: o.occurred_at,
            headers: BTreeMap::new(),
            payload: o.payload.clone(),
        };
        let shown = format!("{e:?} {e:#?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(shown.contains("<14 bytes>"), "{shown}");
    }
}
