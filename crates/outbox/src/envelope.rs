//! The consumer's side of the wire: what a sink wrote, read back as an [`Envelope`].
//!
//! Every sink sends the same envelope — message id, topic, key, occurred-at, the stored
//! headers (correlation id, causation id, `traceparent`/`tracestate`, content type, user
//! headers) and the payload bytes — each in its broker's own vocabulary (headers, record
//! headers, properties, stream fields, user properties, request headers, a JSON line).
//! One function per sink undoes exactly that mapping:
//!
//! | sink | function | reads |
//! | --- | --- | --- |
//! | NATS JetStream (`nats`) | [`from_nats`], [`from_nats_headers`] | message headers |
//! | Kafka (`kafka`) | `from_kafka` | record headers |
//! | RabbitMQ (`rabbitmq`) | [`from_amqp`] | the `headers` table |
//! | Redis Streams (`redis`) | [`from_redis`] | the entry's fields |
//! | MQTT v5 (`mqtt`) | [`from_mqtt`] | user properties |
//! | HTTP webhook (`webhook`) | [`from_webhook`] | request headers, percent-decoded |
//! | stdout / file | [`from_json_line`] | one JSON line |
//!
//! A sink URL with `envelope=cloudevents` sends a CloudEvents 1.0 message instead
//! ([`crate::cloudevents`]): the NATS, Kafka, RabbitMQ, MQTT and webhook decoders read it
//! too, in binary and structured mode, into the same [`Envelope`] (message id from `id`,
//! topic from `type`, key from `partitionkey`, occurred-at from `time`, the headers back
//! under their outbox names). A message with a `message-id` header is always read as the
//! outbox envelope.
//!
//! Each is gated by its sink's feature (the webhook one by `webhook`, which needs no HTTP
//! client; verify the signature first with [`crate::webhook::WebhookSecret::verify_headers`]).
//! What cannot come back identically, by the transport's nature:
//! - NATS: the client trims whitespace (Unicode `White_Space`, so also U+00A0) around every
//!   header value it receives, so a key or header value with leading or trailing spaces
//!   arrives trimmed; user headers named `Nats-…` are the server's namespace and are left out;
//! - HTTP: header names arrive lower-case, and a webhook without a content type is sent as
//!   `application/octet-stream` (read back as no content type);
//! - Redis writes a missing key as an empty field, so an empty key reads back as none.
//!
//! Everything else — non-ASCII header values, binary and empty payloads — comes back byte
//! for byte (the publisher conformance suite checks it against every real broker).
//!
//! A consumer then deduplicates on [`Envelope::message_id`] through the inbox
//! ([`crate::inbox`]) and derives the ids of its follow-up messages with
//! [`Envelope::follow_up_id`].
//!
//! [`Envelope`] and [`EnvelopeError`] are vocabulary, defined in [`crate::message`] (the
//! CloudEvents decoders produce them too); this module reads each sink's wire form into
//! them and imports [`crate::cloudevents`], never the reverse.
//!
//! Errors never quote the payload: a missing or malformed envelope field names the field
//! (and at most 64 characters of its value).
//!

// A link to a decoder whose feature is off in this build leads to the crate's feature table.
#![cfg_attr(not(feature = "nats"), doc = "[`from_nats`]: crate#features")]
#![cfg_attr(not(feature = "nats"), doc = "[`from_nats_headers`]: crate#features")]
#![cfg_attr(not(feature = "rabbitmq"), doc = "[`from_amqp`]: crate#features")]
#![cfg_attr(not(feature = "redis"), doc = "[`from_redis`]: crate#features")]
#![cfg_attr(not(feature = "mqtt"), doc = "[`from_mqtt`]: crate#features")]
#![cfg_attr(not(feature = "webhook"), doc = "[`from_webhook`]: crate#features")]
#![cfg_attr(
    not(feature = "webhook"),
    doc = "[`crate::webhook::WebhookSecret::verify_headers`]: crate#features"
)]

#[cfg(any(
    feature = "nats",
    feature = "kafka",
    feature = "rabbitmq",
    feature = "mqtt",
    feature = "webhook"
))]
use crate::cloudevents::Binding;
use crate::message::{header, snippet};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use uuid::Uuid;

pub use crate::message::{Envelope, EnvelopeError};

/// Collects envelope fields by name, then checks them.
#[derive(Default)]
struct Fields {
    message_id: Option<String>,
    topic: Option<String>,
    key: Option<String>,
    occurred_at: Option<String>,
    headers: BTreeMap<String, String>,
}

fn text(name: &str, value: &[u8]) -> Result<String, EnvelopeError> {
    String::from_utf8(value.to_vec()).map_err(|_| EnvelopeError::NotUtf8(snippet(name)))
}

impl Fields {
    /// One header as a sink wrote it.
    fn push(&mut self, name: &str, value: String) -> Result<(), EnvelopeError> {
        let slot = match name {
            header::MESSAGE_ID => &mut self.message_id,
            header::TOPIC => &mut self.topic,
            header::KEY => &mut self.key,
            header::OCCURRED_AT => &mut self.occurred_at,
            _ => {
                if self.headers.insert(name.to_owned(), value).is_some() {
                    return Err(EnvelopeError::Repeated(snippet(name)));
                }
                return Ok(());
            }
        };
        if slot.replace(value).is_some() {
            return Err(EnvelopeError::Repeated(name.to_owned()));
        }
        Ok(())
    }

    fn push_bytes(&mut self, name: &str, value: &[u8]) -> Result<(), EnvelopeError> {
        let v = text(name, value)?;
        self.push(name, v)
    }

    fn finish(self, payload: Bytes) -> Result<Envelope, EnvelopeError> {
        let id = self
            .message_id
            .ok_or(EnvelopeError::Missing(header::MESSAGE_ID))?;
        let message_id = Uuid::parse_str(&id).map_err(|_| EnvelopeError::Invalid {
            field: header::MESSAGE_ID.into(),
            value: snippet(&id),
            reason: "not a UUID",
        })?;
        let topic = self.topic.ok_or(EnvelopeError::Missing(header::TOPIC))?;
        if topic.is_empty() {
            return Err(EnvelopeError::Invalid {
                field: header::TOPIC.into(),
                value: String::new(),
                reason: "empty",
            });
        }
        let at = self
            .occurred_at
            .ok_or(EnvelopeError::Missing(header::OCCURRED_AT))?;
        let occurred_at = DateTime::parse_from_rfc3339(&at)
            .map_err(|_| EnvelopeError::Invalid {
                field: header::OCCURRED_AT.into(),
                value: snippet(&at),
                reason: "not an RFC 3339 time",
            })?
            .with_timezone(&Utc);
        Ok(Envelope {
            message_id,
            topic,
            key: self.key,
            occurred_at,
            headers: self.headers,
            payload,
        })
    }
}

/// An envelope from header pairs as most sinks write them (the names of
/// [`crate::OutgoingMessage::envelope_headers`], values as UTF-8 bytes) and the payload.
/// Use it for a transport this module has no function for, or a bridge that copied the
/// headers.
///
/// # Errors
/// [`EnvelopeError`] for a missing or invalid row field, a repeated name or a value that is
/// not UTF-8.
pub fn from_headers<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    payload: impl Into<Bytes>,
) -> Result<Envelope, EnvelopeError> {
    let mut f = Fields::default();
    for (name, value) in headers {
        f.push_bytes(name, value)?;
    }
    f.finish(payload.into())
}

/// The value of header `name` (ASCII-case-insensitive) among `pairs`, if it is text.
#[cfg(any(feature = "nats", feature = "kafka"))]
fn find<'a>(pairs: &[(&str, &'a [u8])], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

/// The envelope of a transport's header `pairs`: the CloudEvents form of `binding` when
/// the pairs (or the content type) say so, else the outbox envelope's fields.
#[cfg(any(
    feature = "nats",
    feature = "kafka",
    feature = "rabbitmq",
    feature = "mqtt"
))]
fn from_pairs(
    binding: Binding,
    pairs: &[(&str, &[u8])],
    content_type: Option<&str>,
    payload: Bytes,
) -> Result<Envelope, EnvelopeError> {
    if let Some(ce) = cloudevents_form(binding, pairs, content_type, &payload) {
        return ce;
    }
    let mut f = Fields::default();
    for (name, value) in pairs {
        f.push_bytes(name, value)?;
    }
    f.finish(payload)
}

/// The CloudEvents envelope of a delivery, when it is one (`None`: the outbox envelope):
/// binary mode when an attribute header names `specversion`; structured mode when the
/// content type is a CloudEvents media type and no `message-id` header says it is an
/// outbox envelope whose payload happens to be an event.
#[cfg(any(
    feature = "nats",
    feature = "kafka",
    feature = "rabbitmq",
    feature = "mqtt",
    feature = "webhook"
))]
fn cloudevents_form(
    binding: Binding,
    pairs: &[(&str, &[u8])],
    content_type: Option<&str>,
    payload: &Bytes,
) -> Option<Result<Envelope, EnvelopeError>> {
    let outbox = pairs
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case(header::MESSAGE_ID));
    if outbox {
        return None;
    }
    if crate::cloudevents::is_binary(binding, pairs.iter().map(|(n, _)| *n)) {
        return Some(crate::cloudevents::from_binary(
            binding,
            pairs.iter().copied(),
            content_type,
            payload.clone(),
        ));
    }
    let ct = content_type?;
    if !crate::cloudevents::is_structured_media_type(ct) {
        return None;
    }
    if !crate::cloudevents::is_json_media_type(ct) {
        return Some(Err(EnvelopeError::Malformed(format!(
            "a CloudEvents event format other than JSON: {}",
            snippet(ct)
        ))));
    }
    Some(crate::cloudevents::from_structured(payload))
}

/// Header names NATS itself sets (`Nats-Msg-Id`, and on a direct get or republish
/// `Nats-Stream`, `Nats-Sequence`, `Nats-Time-Stamp`, …): NATS reserves the `Nats-` prefix,
/// so every such name is the transport's, never the envelope's (a user header named
/// `Nats-…` does not come back).
#[cfg(feature = "nats")]
fn is_nats_header(name: &str) -> bool {
    name.as_bytes()
        .get(..5)
        .is_some_and(|p| p.eq_ignore_ascii_case(b"nats-"))
}

/// The envelope of a NATS message ([`crate::sink::nats`] writes it as headers, or as a
/// CloudEvents JSON event with `Content-Type: application/cloudevents+json`). Works on a
/// core or JetStream delivery (`jetstream::Message` dereferences to it).
///
/// # Errors
/// [`EnvelopeError`]; a message without headers is [`EnvelopeError::Missing`].
#[cfg(feature = "nats")]
pub fn from_nats(message: &async_nats::Message) -> Result<Envelope, EnvelopeError> {
    match &message.headers {
        Some(h) => from_nats_headers(h, message.payload.clone()),
        None => Err(EnvelopeError::Missing(header::MESSAGE_ID)),
    }
}

/// [`from_nats`] over a header map and payload, for what is read without a delivery (a
/// stream's direct get, `jetstream::stream::Stream::get_raw_message`). `Nats-…` headers
/// are left out.
///
/// # Errors
/// As [`from_nats`].
#[cfg(feature = "nats")]
pub fn from_nats_headers(
    headers: &async_nats::HeaderMap,
    payload: Bytes,
) -> Result<Envelope, EnvelopeError> {
    let mut pairs: Vec<(&str, &[u8])> = Vec::new();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        if is_nats_header(name) {
            continue;
        }
        match values.as_slice() {
            [v] => pairs.push((name, v.as_str().as_bytes())),
            [] => {}
            _ => return Err(EnvelopeError::Repeated(snippet(name))),
        }
    }
    let content_type = find(&pairs, header::CONTENT_TYPE);
    from_pairs(Binding::Nats, &pairs, content_type, payload)
}

/// The envelope of a Kafka record ([`crate::sink::kafka`] writes it as record headers; the
/// record key is the envelope key too), or a CloudEvent of the Kafka binding (`ce_`
/// headers, or `content-type: application/cloudevents+json`). Takes any `rdkafka`
/// message, borrowed or owned. A null payload reads as empty.
///
/// # Errors
/// [`EnvelopeError`]; a header with a null value is [`EnvelopeError::Invalid`].
#[cfg(feature = "kafka")]
pub fn from_kafka<M: rdkafka::Message>(record: &M) -> Result<Envelope, EnvelopeError> {
    use rdkafka::message::Headers as _;
    let mut pairs: Vec<(&str, &[u8])> = Vec::new();
    if let Some(headers) = record.headers() {
        for h in headers.iter() {
            let value = h.value.ok_or_else(|| EnvelopeError::Invalid {
                field: snippet(h.key),
                value: String::new(),
                reason: "a null header value",
            })?;
            pairs.push((h.key, value));
        }
    }
    let payload = Bytes::copy_from_slice(record.payload().unwrap_or_default());
    let content_type = find(&pairs, header::CONTENT_TYPE);
    from_pairs(Binding::Kafka, &pairs, content_type, payload)
}

/// Headers RabbitMQ adds on the way to a consumer: `x-delivery-count` (quorum queues, a
/// number), `x-death` (dead-lettering, a list), `x-first-death-*` / `x-last-death-*`
/// (strings) and `x-received-from` (shovels, federation)
/// (<https://www.rabbitmq.com/docs/dlx>, <https://www.rabbitmq.com/docs/quorum-queues>).
#[cfg(feature = "rabbitmq")]
fn is_rabbitmq_header(name: &str) -> bool {
    matches!(name, "x-delivery-count" | "x-death" | "x-received-from")
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

/// The envelope of an AMQP 0-9-1 delivery ([`crate::sink::rabbitmq`] writes it in the
/// `headers` table, every value a long string), or a CloudEvent of the AMQP binding
/// (`cloudEvents:` or `cloudEvents_` headers and the `content_type` property, or
/// `content_type` `application/cloudevents+json`). The `message_id` property carries the
/// same id. What RabbitMQ adds on the way (a quorum queue's `x-delivery-count`, the
/// `x-death` history of a dead-lettered message, `x-first-death-*`, `x-last-death-*`,
/// `x-received-from`) and any header whose value is not a string are left out, so a
/// redelivered or dead-lettered message reads like the first delivery.
///
/// # Errors
/// [`EnvelopeError`].
#[cfg(feature = "rabbitmq")]
pub fn from_amqp(delivery: &lapin::message::Delivery) -> Result<Envelope, EnvelopeError> {
    use lapin::types::AMQPValue;
    let mut pairs: Vec<(&str, &[u8])> = Vec::new();
    if let Some(table) = delivery.properties.headers() {
        for (name, value) in table.inner() {
            let name = name.as_str();
            if is_rabbitmq_header(name) {
                continue;
            }
            match value {
                AMQPValue::LongString(s) => pairs.push((name, s.as_bytes())),
                AMQPValue::ShortString(s) => pairs.push((name, s.as_str().as_bytes())),
                // The sink writes every envelope value as a long string: anything else was
                // added on the way (a plugin, a shovel, a policy) and is not the envelope's.
                _ => {}
            }
        }
    }
    let payload = Bytes::copy_from_slice(&delivery.data);
    let content_type = delivery
        .properties
        .content_type()
        .as_ref()
        .map(|c| c.as_str());
    from_pairs(Binding::Amqp, &pairs, content_type, payload)
}

/// The envelope of a Redis stream entry ([`crate::sink::redis_streams`] writes the fields
/// `message_id`, `topic`, `key` (empty for none), `occurred_at`, `headers` (a JSON object
/// of strings) and `payload`), as `XRANGE`, `XREAD` and `XREADGROUP` return it.
///
/// # Errors
/// [`EnvelopeError`]; a field of the wrong type, or `headers` that are not a JSON object of
/// strings, is [`EnvelopeError::Malformed`].
#[cfg(feature = "redis")]
pub fn from_redis(entry: &redis::streams::StreamId) -> Result<Envelope, EnvelopeError> {
    fn field<'a>(
        entry: &'a redis::streams::StreamId,
        name: &'static str,
    ) -> Result<Option<&'a [u8]>, EnvelopeError> {
        match entry.map.get(name) {
            None => Ok(None),
            Some(redis::Value::BulkString(b)) => Ok(Some(b.as_slice())),
            Some(redis::Value::SimpleString(s)) => Ok(Some(s.as_bytes())),
            Some(_) => Err(EnvelopeError::Malformed(format!(
                "stream field {name} is not a string"
            ))),
        }
    }
    let mut f = Fields::default();
    for (name, wire) in [
        ("message_id", header::MESSAGE_ID),
        ("topic", header::TOPIC),
        ("occurred_at", header::OCCURRED_AT),
    ] {
        if let Some(v) = field(entry, name)? {
            f.push_bytes(wire, v)?;
        }
    }
    if let Some(k) = field(entry, "key")?.filter(|k| !k.is_empty()) {
        f.push_bytes(header::KEY, k)?;
    }
    if let Some(h) = field(entry, "headers")? {
        let map: BTreeMap<String, String> = serde_json::from_slice(h).map_err(|_| {
            EnvelopeError::Malformed("stream field headers is not a JSON object of strings".into())
        })?;
        for (name, value) in map {
            // The Redis sink leaves the row fields out of `headers` (they have fields of
            // their own), so one here was not written by it.
            if header::RESERVED.contains(&name.as_str()) {
                return Err(EnvelopeError::Repeated(name));
            }
            f.push(&name, value)?;
        }
    }
    let payload = field(entry, "payload")?.unwrap_or_default();
    f.finish(Bytes::copy_from_slice(payload))
}

/// The envelope of an MQTT v5 publish ([`crate::sink::mqtt`] writes it as user
/// properties, in order; the Content Type property repeats `content-type`), or a
/// CloudEvent of the MQTT binding (user properties named as the attributes and the
/// Content Type property, or Content Type `application/cloudevents+json`).
///
/// # Errors
/// [`EnvelopeError`]; a publish without properties (MQTT 3.1.1) is
/// [`EnvelopeError::Missing`].
#[cfg(feature = "mqtt")]
pub fn from_mqtt(publish: &rumqttc::v5::mqttbytes::v5::Publish) -> Result<Envelope, EnvelopeError> {
    let properties = publish.properties.as_ref();
    let pairs: Vec<(&str, &[u8])> = properties
        .map(|p| p.user_properties.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_bytes()))
        .collect();
    let content_type = properties.and_then(|p| p.content_type.as_deref());
    from_pairs(Binding::Mqtt, &pairs, content_type, publish.payload.clone())
}

/// The envelope of a webhook request ([`crate::sink::http`] writes it as request headers,
/// values percent-encoded where HTTP cannot carry them, the payload as the body), or a
/// CloudEvent of the HTTP binding (`ce-` headers, percent-decoded, with `Content-Type` as
/// `datacontenttype`; or `Content-Type: application/cloudevents+json` and the JSON event). Header
/// names come back lower-case; `Content-Type` is the `content-type` header, except the
/// `application/octet-stream` the sink sends for a message without one (HTTP also trims
/// spaces around it). The names of [`crate::webhook::TRANSPORT_HEADERS`] (HTTP's, a
/// client's, a proxy's, the signing and idempotency headers; the sink never sends a message
/// header with one of them) are left out. Other headers a proxy adds on the way
/// (`x-request-id`, …) cannot be told from the message's own: read the names you expect.
///
/// This reads; it does not authenticate (but a `webhook-id` must equal `message-id`).
/// Use [`from_verified_webhook`] with the signing secret.
///
/// # Errors
/// [`EnvelopeError`]; a value that is not ASCII, or whose percent-decoding is not UTF-8, is
/// [`EnvelopeError::NotUtf8`]; a `webhook-id` other than the message id is
/// [`EnvelopeError::Invalid`].
///
#[cfg_attr(not(feature = "http"), doc = "[`crate::sink::http`]: crate#features")]
#[cfg(feature = "webhook")]
pub fn from_webhook(
    headers: &http::HeaderMap,
    body: impl Into<Bytes>,
) -> Result<Envelope, EnvelopeError> {
    let body = body.into();
    let pairs: Vec<(&str, &[u8])> = headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_bytes()))
        .collect();
    let content_type = match headers.get(http::header::CONTENT_TYPE) {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| EnvelopeError::NotUtf8(header::CONTENT_TYPE.into()))?,
        ),
        None => None,
    };
    let envelope = match cloudevents_form(Binding::Http, &pairs, content_type, &body) {
        Some(ce) => ce?,
        None => outbox_webhook(headers, body)?,
    };
    // A signed delivery's `webhook-id` is the message id: the signature covers it (and the
    // body), not the `message-id` header (nor `ce-id`), so the two must agree or the dedup
    // key could be swapped on a replayed request.
    if let Some(id) = headers.get("webhook-id") {
        let id = id.to_str().unwrap_or_default();
        if id != envelope.message_id.to_string() {
            return Err(EnvelopeError::Invalid {
                field: "webhook-id".into(),
                value: snippet(id),
                reason: "not the message id (message-id or ce-id; the signed id must be the message id)",
            });
        }
    }
    Ok(envelope)
}

/// The outbox envelope of a webhook request (see [`from_webhook`]).
#[cfg(feature = "webhook")]
fn outbox_webhook(headers: &http::HeaderMap, body: Bytes) -> Result<Envelope, EnvelopeError> {
    let mut f = Fields::default();
    for (name, value) in headers {
        let name = name.as_str();
        if crate::webhook::TRANSPORT_HEADERS.contains(&name) {
            continue;
        }
        let raw = value
            .to_str()
            .map_err(|_| EnvelopeError::NotUtf8(snippet(name)))?;
        if name == header::CONTENT_TYPE {
            if raw != "application/octet-stream" {
                f.push(name, raw.to_owned())?;
            }
            continue;
        }
        let decoded = percent_encoding::percent_decode_str(raw)
            .decode_utf8()
            .map_err(|_| EnvelopeError::NotUtf8(snippet(name)))?;
        f.push(name, decoded.into_owned())?;
    }
    f.finish(body)
}

/// Verifies a webhook's Standard Webhooks signature against this host's clock
/// ([`crate::webhook::WebhookSecret::verify_headers`]), then reads its envelope
/// ([`from_webhook`], which also requires `webhook-id` = `message-id`). Only the message
/// id, the timestamp and the body are signed: the other envelope headers (topic, key,
/// correlation id, user headers) are as trustworthy as the connection that carried them.
///
/// # Errors
/// [`WebhookError::Signature`] before anything is read, else [`WebhookError::Envelope`].
#[cfg(feature = "webhook")]
pub fn from_verified_webhook(
    secret: &crate::webhook::WebhookSecret,
    headers: &http::HeaderMap,
    body: impl Into<Bytes>,
) -> Result<Envelope, WebhookError> {
    let body = body.into();
    secret
        .verify_headers(headers, &body)
        .map_err(WebhookError::Signature)?;
    from_webhook(headers, body).map_err(WebhookError::Envelope)
}

/// Why [`from_verified_webhook`] refused a request.
#[cfg(feature = "webhook")]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WebhookError {
    /// The signature did not verify: answer 401 and do nothing else.
    #[error("webhook signature: {0}")]
    Signature(crate::webhook::VerifyError),
    /// Signed, but not an outbox envelope.
    #[error(transparent)]
    Envelope(EnvelopeError),
}

/// The envelope of one line the `stdout` / `file:` sink wrote
/// ([`crate::sink::file::to_json_line`]: `message_id`, `topic`, `key`, `occurred_at`,
/// `headers`, `payload_encoding` (`utf8` or `base64`), `payload`; `attempt` is ignored).
/// A trailing newline is allowed.
///
/// # Errors
/// [`EnvelopeError::Malformed`] for a line that is not such a JSON object, else as the
/// other functions.
pub fn from_json_line(line: &[u8]) -> Result<Envelope, EnvelopeError> {
    let value: serde_json::Value = serde_json::from_slice(line)
        .map_err(|e| EnvelopeError::Malformed(format!("not a JSON line: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| EnvelopeError::Malformed("not a JSON object".into()))?;
    let string = |name: &'static str| -> Result<Option<String>, EnvelopeError> {
        match obj.get(name) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(EnvelopeError::Malformed(format!("{name} is not a string"))),
        }
    };
    let mut f = Fields::default();
    for (name, wire) in [
        ("message_id", header::MESSAGE_ID),
        ("topic", header::TOPIC),
        ("key", header::KEY),
        ("occurred_at", header::OCCURRED_AT),
    ] {
        if let Some(v) = string(name)? {
            f.push(wire, v)?;
        }
    }
    if let Some(h) = obj.get("headers").filter(|h| !h.is_null()) {
        let map: BTreeMap<String, String> = serde_json::from_value(h.clone())
            .map_err(|_| EnvelopeError::Malformed("headers is not an object of strings".into()))?;
        for (name, value) in map {
            // The file sink writes the stored headers as they are, where a row written by
            // hand may carry a `message-id`; the row's own fields win, as in every sink.
            if header::RESERVED.contains(&name.as_str()) {
                continue;
            }
            f.push(&name, value)?;
        }
    }
    let payload = payload_from_json_line(&value).ok_or_else(|| {
        EnvelopeError::Malformed("payload or payload_encoding is missing or invalid".into())
    })?;
    f.finish(Bytes::from(payload))
}

/// Reads the payload of a JSON line written by the file sink
/// ([`crate::sink::file::to_json_line`]) back from its parsed object: the `payload` text as
/// it is for `"payload_encoding": "utf8"`, base64-decoded (standard alphabet, padded) for
/// `"base64"`. `None` when either field is missing, not a string, or the encoding is
/// unknown or its text is not valid base64.
pub fn payload_from_json_line(value: &serde_json::Value) -> Option<Vec<u8>> {
    use base64::Engine as _;
    let payload = value.get("payload")?.as_str()?;
    match value.get("payload_encoding")?.as_str()? {
        "utf8" => Some(payload.as_bytes().to_vec()),
        "base64" => base64::engine::general_purpose::STANDARD
            .decode(payload)
            .ok(),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::OutgoingMessage;

    fn outgoing() -> OutgoingMessage {
        let mut headers = BTreeMap::new();
        headers.insert("tenant".to_owned(), "grüße ✓".to_owned());
        headers.insert(header::CORRELATION_ID.to_owned(), "req-7".to_owned());
        OutgoingMessage {
            id: 1,
            message_id: Uuid::now_v7(),
            topic: "orders.placed.v1".into(),
            key: Some("order-42".into()),
            payload: Bytes::from_static(&[0, 159, 146, 150, 255]),
            headers,
            occurred_at: DateTime::parse_from_rfc3339("2026-11-30T10:11:12.123456Z")
                .unwrap()
                .with_timezone(&Utc),
            attempts: 2,
        }
    }

    #[test]
    fn header_pairs_round_trip() {
        let m = outgoing();
        let pairs = m.envelope_headers();
        let env = from_headers(
            pairs.iter().map(|(n, v)| (*n, v.as_bytes())),
            m.payload.clone(),
        )
        .unwrap();
        assert_eq!(env.message_id, m.message_id);
        assert_eq!(env.topic, m.topic);
        assert_eq!(env.key, m.key);
        assert_eq!(env.occurred_at, m.occurred_at);
        assert_eq!(env.headers, m.headers);
        assert_eq!(env.payload, m.payload);
        assert_eq!(env.correlation_id(), Some("req-7"));
        assert_eq!(
            env.wire_headers(),
            pairs
                .into_iter()
                .map(|(n, v)| (n.to_owned(), v))
                .collect::<BTreeMap<_, _>>()
        );
        assert_eq!(
            env.follow_up_id("x"),
            crate::message::follow_up_id(m.message_id, "x")
        );
    }

    #[test]
    fn bad_envelopes_are_named_not_guessed() {
        let m = outgoing();
        let id = m.message_id.to_string();
        let ok: Vec<(&str, &[u8])> = vec![
            ("message-id", id.as_bytes()),
            ("topic", b"t"),
            ("occurred-at", b"2026-11-30T10:11:12Z"),
        ];
        assert!(from_headers(ok.clone(), Bytes::new()).is_ok());
        let without = |name: &str| -> Vec<(&str, &[u8])> {
            ok.iter().filter(|(n, _)| *n != name).cloned().collect()
        };
        for name in ["message-id", "topic", "occurred-at"] {
            assert_eq!(
                from_headers(without(name), Bytes::new()),
                Err(EnvelopeError::Missing(match name {
                    "message-id" => header::MESSAGE_ID,
                    "topic" => header::TOPIC,
                    _ => header::OCCURRED_AT,
                }))
            );
        }
        let mut bad = without("message-id");
        bad.push(("message-id", b"42"));
        assert!(matches!(
            from_headers(bad, Bytes::new()),
            Err(EnvelopeError::Invalid {
                reason: "not a UUID",
                ..
            })
        ));
        let mut bad = without("occurred-at");
        bad.push(("occurred-at", b"yesterday"));
        assert!(matches!(
            from_headers(bad, Bytes::new()),
            Err(EnvelopeError::Invalid { .. })
        ));
        let mut twice = ok.clone();
        twice.push(("topic", b"u"));
        assert_eq!(
            from_headers(twice, Bytes::new()),
            Err(EnvelopeError::Repeated("topic".into()))
        );
        let mut binary = ok.clone();
        binary.push(("tenant", &[0xff, 0xfe]));
        assert_eq!(
            from_headers(binary, Bytes::new()),
            Err(EnvelopeError::NotUtf8("tenant".into()))
        );
        assert!(matches!(
            from_json_line(b"{not json"),
            Err(EnvelopeError::Malformed(_))
        ));
        // The payload never reaches an error message.
        let line = br#"{"topic":"t","occurred_at":"2026-11-30T10:11:12Z","payload_encoding":"utf8","payload":"secret-payload"}"#;
        let e = from_json_line(line).unwrap_err();
        assert_eq!(e, EnvelopeError::Missing(header::MESSAGE_ID));
        assert!(!e.to_string().contains("secret-payload"));
    }

    #[cfg(feature = "webhook")]
    #[test]
    fn webhook_headers_are_percent_decoded_and_transport_left_out() {
        let m = outgoing();
        let mut h = http::HeaderMap::new();
        for (n, v) in m.envelope_headers() {
            let enc: String = v
                .bytes()
                .map(|b| {
                    if b.is_ascii_graphic() && b != b'%' {
                        char::from(b).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            h.insert(
                http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                http::HeaderValue::from_str(&enc).unwrap(),
            );
        }
        for (n, v) in [
            ("content-type", "application/octet-stream"),
            ("user-agent", "x"),
            ("idempotency-key", "y"),
            ("host", "h"),
        ] {
            h.insert(n, http::HeaderValue::from_static(v));
        }
        let env = from_webhook(&h, m.payload.clone()).unwrap();
        assert_eq!(env.headers, m.headers);
        assert_eq!(env.key, m.key);
        h.insert("content-type", http::HeaderValue::from_static("text/plain"));
        let env = from_webhook(&h, m.payload.clone()).unwrap();
        assert_eq!(env.content_type(), Some("text/plain"));
    }

    #[cfg(feature = "webhook")]
    #[test]
    fn a_signed_webhook_must_name_its_message_id_and_verify() {
        use crate::webhook::{VerifyError, WebhookSecret};
        let m = outgoing();
        let secret = WebhookSecret::from_bytes(b"key".to_vec());
        let mut h = http::HeaderMap::new();
        for (n, v) in m.envelope_headers() {
            let v: String = v.bytes().map(|b| format!("%{b:02X}")).collect();
            h.insert(
                http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                http::HeaderValue::from_str(&v).unwrap(),
            );
        }
        let id = m.message_id.to_string();
        let now = chrono::Utc::now().timestamp();
        h.insert("webhook-id", http::HeaderValue::from_str(&id).unwrap());
        h.insert("webhook-timestamp", http::HeaderValue::from(now));
        h.insert(
            "webhook-signature",
            http::HeaderValue::from_str(&secret.sign(&id, now, &m.payload)).unwrap(),
        );
        let env = from_verified_webhook(&secret, &h, m.payload.clone()).unwrap();
        assert_eq!(env.message_id, m.message_id);
        assert_eq!(
            from_verified_webhook(&secret, &h, Bytes::from_static(b"other")),
            Err(WebhookError::Signature(VerifyError::NoMatch))
        );
        // A captured request replayed under another message id: the signature still holds
        // (it covers webhook-id, not message-id), the envelope does not.
        let mut replayed = h.clone();
        replayed.insert(
            "message-id",
            http::HeaderValue::from_str(&Uuid::now_v7().to_string()).unwrap(),
        );
        assert!(matches!(
            from_verified_webhook(&secret, &replayed, m.payload.clone()),
            Err(WebhookError::Envelope(EnvelopeError::Invalid { ref field, .. })) if field == "webhook-id"
        ));
    }

    #[cfg(feature = "nats")]
    #[test]
    fn nats_names_are_never_sliced_inside_a_character() {
        let m = outgoing();
        let mut h = async_nats::HeaderMap::new();
        for (n, v) in m.envelope_headers() {
            h.insert(n, v.as_str());
        }
        h.insert(async_nats::HeaderName::from_static("näts-x"), "y");
        h.insert("Nats-Msg-Id", id_of(&m).as_str());
        let env = from_nats_headers(&h, m.payload.clone()).unwrap();
        assert_eq!(env.header("näts-x"), Some("y"));
        assert_eq!(env.header("Nats-Msg-Id"), None);
    }

    #[cfg(feature = "webhook")]
    #[test]
    fn webhooks_read_cloudevents_in_both_modes() {
        use crate::cloudevents::{Binding, CloudEvents, Mode};
        let m = outgoing();
        let ce = CloudEvents::new(Mode::Binary, "/shop").unwrap();
        let event = ce.event(&m).unwrap();
        let mut h = http::HeaderMap::new();
        for (n, v) in event.binary_headers(Binding::Http) {
            h.insert(
                http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                http::HeaderValue::from_str(&v).unwrap(),
            );
        }
        h.insert("idempotency-key", http::HeaderValue::from_static("x"));
        h.insert("webhook-id", m.message_id.to_string().parse().unwrap());
        let env = from_webhook(&h, m.payload.clone()).unwrap();
        assert_eq!(
            env.wire_headers(),
            from_headers(
                m.envelope_headers().iter().map(|(n, v)| (*n, v.as_bytes())),
                m.payload.clone(),
            )
            .unwrap()
            .wire_headers()
        );
        assert_eq!(env.payload, m.payload);
        // The signed id must be `ce-id`.
        h.insert("webhook-id", http::HeaderValue::from_static("other"));
        assert!(matches!(
            from_webhook(&h, m.payload.clone()),
            Err(EnvelopeError::Invalid { ref field, .. }) if field == "webhook-id"
        ));
        let json = event.to_json();
        let mut h = http::HeaderMap::new();
        h.insert(
            "content-type",
            http::HeaderValue::from_static("application/cloudevents+json; charset=utf-8"),
        );
        let env = from_webhook(&h, json).unwrap();
        assert_eq!(env.message_id, m.message_id);
        assert_eq!(env.headers, m.headers);
        assert_eq!(env.payload, m.payload);
        // A non-JSON event format is named, not guessed.
        h.insert(
            "content-type",
            http::HeaderValue::from_static("application/cloudevents+avro"),
        );
        assert!(matches!(
            from_webhook(&h, Bytes::new()),
            Err(EnvelopeError::Malformed(_))
        ));
    }

    #[cfg(feature = "nats")]
    #[test]
    fn nats_reads_structured_and_draft_binary_cloudevents() {
        use crate::cloudevents::{Binding, CloudEvents, Mode};
        let m = outgoing();
        let event = CloudEvents::new(Mode::Structured, "/shop")
            .unwrap()
            .event(&m)
            .unwrap();
        let mut h = async_nats::HeaderMap::new();
        h.insert("Content-Type", crate::cloudevents::JSON_FORMAT);
        h.insert("Nats-Msg-Id", id_of(&m).as_str());
        let env = from_nats_headers(&h, Bytes::from(event.to_json())).unwrap();
        assert_eq!(env.message_id, m.message_id);
        assert_eq!(env.key, m.key);
        assert_eq!(env.headers, m.headers);
        assert_eq!(env.payload, m.payload);
        // The binding's 1.0.3 draft: `ce-` headers, `ce-datacontenttype`.
        let mut h = async_nats::HeaderMap::new();
        for (n, v) in event.binary_headers(Binding::Nats) {
            h.insert(n.as_str(), v.as_str());
        }
        h.insert("ce-datacontenttype", "application/octet-stream");
        let env = from_nats_headers(&h, m.payload.clone()).unwrap();
        assert_eq!(env.header("tenant"), Some("grüße ✓"));
        assert_eq!(env.content_type(), Some("application/octet-stream"));
    }

    #[cfg(feature = "mqtt")]
    #[test]
    fn mqtt_reads_binary_cloudevents() {
        use crate::cloudevents::{Binding, CloudEvents, Mode};
        use rumqttc::v5::mqttbytes::{QoS, v5::Publish, v5::PublishProperties};
        let mut m = outgoing();
        m.headers
            .insert("content-type".into(), "application/x-protobuf".into());
        let event = CloudEvents::new(Mode::Binary, "/shop")
            .unwrap()
            .event(&m)
            .unwrap();
        let properties = PublishProperties {
            user_properties: event.binary_headers(Binding::Mqtt),
            content_type: event.datacontenttype.clone(),
            ..PublishProperties::default()
        };
        let p = Publish::new("t", QoS::AtLeastOnce, m.payload.clone(), Some(properties));
        let env = from_mqtt(&p).unwrap();
        assert_eq!(env.message_id, m.message_id);
        assert_eq!(env.headers, m.headers);
        assert_eq!(env.payload, m.payload);
    }

    #[cfg(feature = "nats")]
    fn id_of(m: &OutgoingMessage) -> String {
        m.message_id.to_string()
    }
}
