//! CloudEvents 1.0 as a sink's envelope, opt-in per sink URL: the one mapping between an
//! [`OutgoingMessage`] and a CloudEvent, shared by every sink that has a CloudEvents
//! protocol binding and by the decoders of [`crate::envelope`].
//!
//! Sources (<https://github.com/cloudevents/spec>, version 1.0.2): the specification
//! (`cloudevents/spec.md`: attributes, naming, type system), the JSON event format
//! (`cloudevents/formats/json-format.md`), the Partitioning and Distributed Tracing
//! extensions (`cloudevents/extensions/partitioning.md`,
//! `cloudevents/extensions/distributed-tracing.md`) and the protocol bindings
//! (`cloudevents/bindings/http-protocol-binding.md`, `kafka-protocol-binding.md`,
//! `amqp-protocol-binding.md`, `mqtt-protocol-binding.md`, `nats-protocol-binding.md`).
//!
//! ## Selecting it
//!
//! A sink URL's query parameter `envelope` (the webhook sink: `outbox_envelope`) chooses:
//! `outbox` (the default: the envelope of [`OutgoingMessage::envelope_headers`]),
//! `cloudevents` (the binding's binary content mode; NATS: structured),
//! `cloudevents-binary` or `cloudevents-structured`. `ce_source` (the webhook sink:
//! `outbox_ce_source`) sets the `source` attribute, a URI-reference (default
//! [`DEFAULT_SOURCE`]). Redis Streams and stdout/file have no protocol binding and refuse
//! the parameter.
//!
//! ## Attributes
//!
//! | attribute | from |
//! | --- | --- |
//! | `specversion` | `1.0` |
//! | `id` | the message id |
//! | `source` | `ce_source` |
//! | `type` | the topic |
//! | `time` | occurred-at, RFC 3339 in UTC with microseconds |
//! | `datacontenttype` | the `content-type` header, when present |
//! | `subject`, `dataschema` | the headers of these names, when present |
//! | `partitionkey` (Partitioning) | the key, when present and not empty |
//! | `traceparent`, `tracestate` (Distributed Tracing) | the headers of these names |
//! | `correlationid`, `causationid` | the `correlation-id` and `causation-id` headers |
//! | any other extension | a header whose name is a valid attribute name |
//!
//! The outbox's own `message-id`, `topic`, `key` and `occurred-at` headers are not sent:
//! the attributes carry them. What a transport uses for its own deduplication stays
//! (`Nats-Msg-Id`, the AMQP `message_id` property, `Idempotency-Key` and the Standard
//! Webhooks `webhook-id`), each the message id, as does the AMQP `timestamp` property.
//!
//! Every stored header must become an attribute, so a message the mapping cannot express
//! fails permanently (code `invalid_header`) before anything is sent, naming the header:
//! a header name that is not 1-[`MAX_NAME_LEN`] characters of `a-z` and `0-9` (the
//! specification's rule and its length recommendation, which some SDKs enforce), a header
//! named like an attribute the envelope sets itself (`specversion`, `id`, `source`, `type`,
//! `time`, `datacontenttype`, `data`, `partitionkey`, `correlationid`, `causationid`), a
//! value with a control character (U+0000-U+001F, U+007F-U+009F) or a Unicode
//! noncharacter, an empty `content-type`, `subject` or `dataschema`, a `content-type` that
//! is not printable ASCII, a `dataschema` that is not an absolute URI.
//!
//! ## Bindings and content modes
//!
//! | sink | binding | binary mode | structured mode |
//! | --- | --- | --- | --- |
//! | webhook | HTTP | `ce-` headers, values percent-encoded (§3.1.3.2); `Content-Type` = `datacontenttype` (none without one); body = payload | `Content-Type: application/cloudevents+json`; body = the JSON event |
//! | Kafka | Kafka | `ce_` record headers (UTF-8); `content-type` header = `datacontenttype`; record key = key (= `partitionkey`) | `content-type: application/cloudevents+json`; value = the JSON event; record key = key |
//! | RabbitMQ | AMQP | `cloudEvents:` entries of the `headers` table (long strings, the canonical string form); `content_type` property = `datacontenttype` | `content_type` = `application/cloudevents+json`; body = the JSON event |
//! | MQTT v5 | MQTT | user properties named as the attributes; Content Type property = `datacontenttype` | Content Type = `application/cloudevents+json`; payload = the JSON event |
//! | NATS | NATS | not in binding 1.0.2 (refused) | header `Content-Type: application/cloudevents+json`; payload = the JSON event |
//!
//! The JSON event carries the payload as `data` (the JSON text itself) when
//! `datacontenttype` is JSON (`application/json`, `…/…+json`, `text/json`, with any
//! parameters) and the payload is JSON without leading or trailing whitespace, else as
//! `data_base64`; an empty payload carries neither.
//!
//! ## Reading it back
//!
//! Each `envelope::from_*` decoder reads both its sink's outbox envelope and these forms
//! into the same [`crate::Envelope`]: message id from `id`, topic from `type`, key from
//! `partitionkey`, occurred-at from `time`, the headers back under their outbox names. It
//! also reads what other CloudEvents producers send on the same binding: the AMQP
//! `cloudEvents_` prefix, a `datacontenttype` user property (MQTT), NATS binary mode
//! (`ce-` headers, the binding's 1.0.3 working draft), double-quoted HTTP header values,
//! non-string JSON attribute values (as their canonical strings). `source` is not part of
//! the envelope; `id` must be a UUID (it is the outbox's message id).
//! [`from_binary`] and [`from_structured`] do the same for a transport without a decoder.

use crate::error::{PublishCode, PublishError};
use crate::message::{OutgoingMessage, header};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use std::collections::BTreeMap;

mod decode;

pub use decode::{from_binary, from_structured, is_binary, percent_decode, percent_encode};

/// The `specversion` attribute's value.
pub const SPEC_VERSION: &str = "1.0";
/// The `source` attribute when the sink URL names none.
pub const DEFAULT_SOURCE: &str = "/outbox";
/// The media type of the JSON event format (structured content mode).
pub const JSON_FORMAT: &str = "application/cloudevents+json";
/// The query parameter that selects the envelope (`outbox_envelope` for webhooks).
pub const ENVELOPE_PARAM: &str = "envelope";
/// The query parameter that sets `source` (`outbox_ce_source` for webhooks).
pub const SOURCE_PARAM: &str = "ce_source";
/// Longest attribute name accepted, in characters (the specification's recommendation).
pub const MAX_NAME_LEN: usize = 20;

/// Attribute names the mapping uses.
pub mod attr {
    /// Specification version, always [`super::SPEC_VERSION`].
    pub const SPECVERSION: &str = "specversion";
    /// The message id.
    pub const ID: &str = "id";
    /// The configured source.
    pub const SOURCE: &str = "source";
    /// The topic.
    pub const TYPE: &str = "type";
    /// Occurred-at.
    pub const TIME: &str = "time";
    /// The `content-type` header.
    pub const DATACONTENTTYPE: &str = "datacontenttype";
    /// A `dataschema` header (an absolute URI).
    pub const DATASCHEMA: &str = "dataschema";
    /// A `subject` header.
    pub const SUBJECT: &str = "subject";
    /// The key (Partitioning extension).
    pub const PARTITIONKEY: &str = "partitionkey";
    /// W3C `traceparent` (Distributed Tracing extension).
    pub const TRACEPARENT: &str = "traceparent";
    /// W3C `tracestate` (Distributed Tracing extension).
    pub const TRACESTATE: &str = "tracestate";
    /// The `correlation-id` header.
    pub const CORRELATIONID: &str = "correlationid";
    /// The `causation-id` header.
    pub const CAUSATIONID: &str = "causationid";

    /// Names the envelope sets itself: a header of one of these names is refused.
    pub const SET_BY_ENVELOPE: [&str; 10] = [
        SPECVERSION,
        ID,
        SOURCE,
        TYPE,
        TIME,
        DATACONTENTTYPE,
        "data",
        PARTITIONKEY,
        CORRELATIONID,
        CAUSATIONID,
    ];
}

/// How the event travels: attributes as transport metadata, or the whole event in the
/// payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Attributes as headers or properties, the payload unchanged.
    Binary,
    /// The JSON event format as the payload.
    Structured,
}

/// A CloudEvents protocol binding: how attributes are named on a transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Binding {
    /// `http-protocol-binding.md`: `ce-` headers, percent-encoded values.
    Http,
    /// `kafka-protocol-binding.md`: `ce_` record headers.
    Kafka,
    /// `amqp-protocol-binding.md`: `cloudEvents:` application properties (RabbitMQ's
    /// `headers` table).
    Amqp,
    /// `mqtt-protocol-binding.md`: MQTT v5 user properties named as the attributes.
    Mqtt,
    /// `nats-protocol-binding.md`: structured mode only (1.0.2).
    Nats,
}

impl Binding {
    /// The prefix of an attribute's header or property name in binary mode.
    pub fn prefix(self) -> &'static str {
        match self {
            Binding::Http | Binding::Nats => "ce-",
            Binding::Kafka => "ce_",
            Binding::Amqp => "cloudEvents:",
            Binding::Mqtt => "",
        }
    }

    /// What `envelope=cloudevents` means on this binding: binary mode, except for NATS.
    pub fn default_mode(self) -> Mode {
        match self {
            Binding::Nats => Mode::Structured,
            _ => Mode::Binary,
        }
    }

    /// Whether this sink writes `mode` (NATS binding 1.0.2 has no binary mode).
    pub fn writes(self, mode: Mode) -> bool {
        !(self == Binding::Nats && mode == Mode::Binary)
    }

    fn name(self) -> &'static str {
        match self {
            Binding::Http => "HTTP",
            Binding::Kafka => "Kafka",
            Binding::Amqp => "AMQP",
            Binding::Mqtt => "MQTT",
            Binding::Nats => "NATS",
        }
    }

    /// Whether attribute values are percent-encoded in headers (HTTP, NATS).
    fn percent_encoded(self) -> bool {
        matches!(self, Binding::Http | Binding::Nats)
    }
}

/// CloudEvents settings of a sink: the content mode and the `source` attribute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    mode: Mode,
    source: String,
}

impl CloudEvents {
    /// Settings for `mode` with `source` (a URI-reference, RFC 3986 §4.1).
    ///
    /// # Errors
    /// A sentence saying why `source` is not a URI-reference.
    pub fn new(mode: Mode, source: impl Into<String>) -> Result<Self, String> {
        let source = source.into();
        check_uri_reference(&source)?;
        Ok(CloudEvents { mode, source })
    }

    /// The content mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The `source` attribute.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// `m` as a CloudEvent.
    ///
    /// # Errors
    /// A permanent [`PublishError`] (code `invalid_header`) for a message the mapping
    /// cannot express (see the module docs).
    pub fn event(&self, m: &OutgoingMessage) -> Result<Event, PublishError> {
        Event::new(m, &self.source)
    }
}

/// What [`EnvelopeFormat::properties`] gives a sink: the named string properties, the
/// content type and the body.
pub type Properties = (Vec<(String, String)>, Option<String>, bytes::Bytes);

/// The envelope a sink writes, from its URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum EnvelopeFormat {
    /// The outbox envelope ([`OutgoingMessage::envelope_headers`]).
    #[default]
    Outbox,
    /// CloudEvents.
    CloudEvents(CloudEvents),
}

impl EnvelopeFormat {
    /// The envelope a sink URL asks for: `envelope` and `source` are the values of its
    /// `{prefix}envelope` and `{prefix}ce_source` parameters (`prefix` only names them in
    /// errors).
    ///
    /// # Errors
    /// A sentence for an unknown `envelope`, a mode `binding` does not write, a `source`
    /// without CloudEvents or one that is not a URI-reference.
    pub fn parse(
        binding: Binding,
        prefix: &str,
        envelope: Option<&str>,
        source: Option<&str>,
    ) -> Result<Self, String> {
        let mode = match envelope {
            None | Some("outbox") => {
                if source.is_some() {
                    return Err(format!(
                        "{prefix}{SOURCE_PARAM} needs {prefix}{ENVELOPE_PARAM}=cloudevents"
                    ));
                }
                return Ok(EnvelopeFormat::Outbox);
            }
            Some("cloudevents") => binding.default_mode(),
            Some("cloudevents-binary") => Mode::Binary,
            Some("cloudevents-structured") => Mode::Structured,
            Some(other) => {
                return Err(format!(
                    "{prefix}{ENVELOPE_PARAM}={other:?} is not one of outbox, cloudevents, cloudevents-binary, cloudevents-structured"
                ));
            }
        };
        if !binding.writes(mode) {
            return Err(format!(
                "the CloudEvents {} binding (nats-protocol-binding.md 1.0.2) defines only the structured content mode: use {prefix}{ENVELOPE_PARAM}=cloudevents",
                binding.name()
            ));
        }
        let source = source.unwrap_or(DEFAULT_SOURCE);
        CloudEvents::new(mode, source)
            .map(EnvelopeFormat::CloudEvents)
            .map_err(|e| format!("{prefix}{SOURCE_PARAM}: {e}"))
    }

    /// For a sink without a CloudEvents protocol binding (`sink` names it): `Ok` unless
    /// the URL asks for CloudEvents.
    ///
    /// # Errors
    /// A sentence saying that `sink` has no binding.
    pub fn refuse(sink: &str, envelope: Option<&str>, source: Option<&str>) -> Result<(), String> {
        match (envelope, source) {
            (None | Some("outbox"), None) => Ok(()),
            (None | Some("outbox"), Some(_)) => Err(format!(
                "{SOURCE_PARAM} is for envelope=cloudevents, which {sink} does not support"
            )),
            (Some(e), _) if e.starts_with("cloudevents") => Err(format!(
                "{ENVELOPE_PARAM}={e}: CloudEvents defines no protocol binding for {sink}, so this sink cannot send CloudEvents (use a NATS, Kafka, RabbitMQ, MQTT or webhook sink for them, or leave envelope= out)"
            )),
            (Some(e), _) => Err(format!(
                "{ENVELOPE_PARAM}={e:?} is not one of outbox, cloudevents, cloudevents-binary, cloudevents-structured ({sink} supports only outbox)"
            )),
        }
    }

    /// What a sink that carries named string properties (AMQP headers, MQTT user
    /// properties) sends for `m` on `binding`: the property pairs, the content type and
    /// the body. The outbox envelope: [`OutgoingMessage::envelope_headers`], the
    /// `content-type` header and the payload; binary mode: the binding's attribute
    /// properties, `datacontenttype` and the data; structured mode: no properties,
    /// [`JSON_FORMAT`] and the JSON event.
    ///
    /// # Errors
    /// A permanent [`PublishError`] when the message cannot be a CloudEvent (see the module
    /// docs).
    pub fn properties(
        &self,
        m: &OutgoingMessage,
        binding: Binding,
    ) -> Result<Properties, PublishError> {
        let Some(ce) = self.cloudevents() else {
            return Ok((
                m.envelope_headers()
                    .into_iter()
                    .map(|(n, v)| (n.to_owned(), v))
                    .collect(),
                m.headers.get(crate::message::header::CONTENT_TYPE).cloned(),
                m.payload.clone(),
            ));
        };
        let event = ce.event(m)?;
        Ok(match ce.mode() {
            Mode::Binary => (
                event.binary_headers(binding),
                event.datacontenttype.clone(),
                event.data.clone(),
            ),
            Mode::Structured => (
                Vec::new(),
                Some(JSON_FORMAT.to_owned()),
                bytes::Bytes::from(event.to_json()),
            ),
        })
    }

    /// The CloudEvents settings, when chosen.
    pub fn cloudevents(&self) -> Option<&CloudEvents> {
        match self {
            EnvelopeFormat::Outbox => None,
            EnvelopeFormat::CloudEvents(c) => Some(c),
        }
    }

    /// A short tag for a sink's description (`""` for the outbox envelope).
    pub fn describe(&self) -> String {
        match self {
            EnvelopeFormat::Outbox => String::new(),
            EnvelopeFormat::CloudEvents(c) => format!(
                " (CloudEvents {}, source {})",
                match c.mode {
                    Mode::Binary => "binary",
                    Mode::Structured => "structured",
                },
                c.source
            ),
        }
    }
}

/// One message as a CloudEvent: its attributes as canonical strings and its data.
#[derive(Clone, PartialEq, Eq)]
pub struct Event {
    /// Every attribute but `datacontenttype`, in the order they are written:
    /// `specversion`, `id`, `source`, `type`, `time`, then `subject`, `dataschema`,
    /// `partitionkey`, `traceparent`, `tracestate`, `correlationid`, `causationid` when
    /// present, then the other extensions by name.
    pub attributes: Vec<(String, String)>,
    /// `datacontenttype`, which each binding's binary mode carries in the transport's own
    /// content type.
    pub datacontenttype: Option<String>,
    /// The payload.
    pub data: Bytes,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("attributes", &self.attributes)
            .field("datacontenttype", &self.datacontenttype)
            .field("data", &format_args!("<{} bytes>", self.data.len()))
            .finish()
    }
}

fn refused(message: String) -> PublishError {
    PublishError::permanent(message).with_code(PublishCode::InvalidHeader)
}

impl Event {
    /// `m` as a CloudEvent with `source`.
    ///
    /// # Errors
    /// As [`CloudEvents::event`].
    pub fn new(m: &OutgoingMessage, source: &str) -> Result<Self, PublishError> {
        let mut attributes: Vec<(String, String)> = vec![
            (attr::SPECVERSION.into(), SPEC_VERSION.into()),
            (attr::ID.into(), m.message_id.to_string()),
            (attr::SOURCE.into(), source.to_owned()),
            (attr::TYPE.into(), m.topic.clone()),
            (
                attr::TIME.into(),
                m.occurred_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            ),
        ];
        check_value("the topic (type)", &m.topic)?;
        if m.topic.is_empty() {
            return Err(refused("the topic (type) is empty".into()));
        }
        let mut known: BTreeMap<&'static str, String> = BTreeMap::new();
        let mut extensions: BTreeMap<&str, String> = BTreeMap::new();
        let mut datacontenttype = None;
        if let Some(key) = m.key.as_deref().filter(|k| !k.is_empty()) {
            check_value("the key (partitionkey)", key)?;
            known.insert(attr::PARTITIONKEY, key.to_owned());
        }
        for (name, value) in &m.headers {
            let name = name.as_str();
            // The row's own fields, as in `envelope_headers`: never from a header.
            if header::RESERVED.contains(&name) {
                continue;
            }
            check_value(&format!("header {name:?}"), value)?;
            let target = match name {
                header::CONTENT_TYPE => {
                    if value.is_empty() || !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
                        return Err(refused(format!(
                            "header \"content-type\" {value:?} cannot be the CloudEvents datacontenttype: a media type is non-empty printable ASCII"
                        )));
                    }
                    datacontenttype = Some(value.clone());
                    continue;
                }
                header::CORRELATION_ID => attr::CORRELATIONID,
                header::CAUSATION_ID => attr::CAUSATIONID,
                header::TRACEPARENT => attr::TRACEPARENT,
                header::TRACESTATE => attr::TRACESTATE,
                attr::SUBJECT => attr::SUBJECT,
                attr::DATASCHEMA => attr::DATASCHEMA,
                other => {
                    if attr::SET_BY_ENVELOPE.contains(&other) {
                        return Err(refused(format!(
                            "header {other:?} is a CloudEvents attribute the envelope sets itself (from the message id, topic, key, occurred-at, content-type, correlation-id or causation-id, and the sink's source): rename the header"
                        )));
                    }
                    if !is_attribute_name(other) {
                        return Err(refused(format!(
                            "header {other:?} cannot be a CloudEvents extension attribute: attribute names are 1-{MAX_NAME_LEN} characters of a-z and 0-9 (rename the header, or send this topic through a sink without envelope=cloudevents)"
                        )));
                    }
                    extensions.insert(other, value.clone());
                    continue;
                }
            };
            if (target == attr::SUBJECT || target == attr::DATASCHEMA) && value.is_empty() {
                return Err(refused(format!(
                    "header {name:?} is empty: the CloudEvents {target} attribute must not be"
                )));
            }
            if target == attr::DATASCHEMA && url::Url::parse(value).is_err() {
                return Err(refused(format!(
                    "header \"dataschema\" {value:?} is not an absolute URI, as the CloudEvents dataschema attribute must be"
                )));
            }
            known.insert(target, value.clone());
        }
        for name in [
            attr::SUBJECT,
            attr::DATASCHEMA,
            attr::PARTITIONKEY,
            attr::TRACEPARENT,
            attr::TRACESTATE,
            attr::CORRELATIONID,
            attr::CAUSATIONID,
        ] {
            if let Some(v) = known.remove(name) {
                attributes.push((name.to_owned(), v));
            }
        }
        attributes.extend(
            extensions
                .into_iter()
                .map(|(n, v)| (n.to_owned(), v.to_owned())),
        );
        Ok(Event {
            attributes,
            datacontenttype,
            data: m.payload.clone(),
        })
    }

    /// An attribute's value by name (`datacontenttype` included).
    pub fn attribute(&self, name: &str) -> Option<&str> {
        if name == attr::DATACONTENTTYPE {
            return self.datacontenttype.as_deref();
        }
        self.attributes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The binary-mode header pairs of `binding`: every attribute but `datacontenttype`,
    /// named with the binding's prefix, values percent-encoded where the binding says so
    /// (HTTP, NATS: [`percent_encode`]). `datacontenttype` goes into the transport's own
    /// content type (HTTP `Content-Type`, Kafka `content-type`, the AMQP `content_type`
    /// and MQTT Content Type properties).
    pub fn binary_headers(&self, binding: Binding) -> Vec<(String, String)> {
        let prefix = binding.prefix();
        self.attributes
            .iter()
            .map(|(n, v)| {
                let value = if binding.percent_encoded() {
                    percent_encode(v)
                } else {
                    v.clone()
                };
                (format!("{prefix}{n}"), value)
            })
            .collect()
    }

    /// The event in the JSON event format (`json-format.md`), for structured mode: the
    /// attributes as strings, then `data` or `data_base64` (see the module docs).
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.data.len() * 4 / 3 + 256);
        out.push(b'{');
        let mut first = true;
        let mut member = |out: &mut Vec<u8>, name: &str, value: &[u8]| {
            if !first {
                out.push(b',');
            }
            first = false;
            // Names and string values through serde_json: always valid JSON strings.
            out.extend_from_slice(json_string(name).as_bytes());
            out.push(b':');
            out.extend_from_slice(value);
        };
        let mut all: Vec<(&str, &str)> = self
            .attributes
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        if let Some(ct) = &self.datacontenttype {
            // After `time`, as the specification lists it.
            let at = all.len().min(5);
            all.insert(at, (attr::DATACONTENTTYPE, ct));
        }
        for (n, v) in all {
            member(&mut out, n, json_string(v).as_bytes());
        }
        if !self.data.is_empty() {
            if self
                .datacontenttype
                .as_deref()
                .is_some_and(is_json_media_type)
                && is_exact_json(&self.data)
            {
                member(&mut out, "data", &self.data);
            } else {
                member(
                    &mut out,
                    "data_base64",
                    json_string(&BASE64.encode(&self.data)).as_bytes(),
                );
            }
        }
        out.push(b'}');
        out
    }
}

fn json_string(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

/// The payload is JSON text with nothing around it, so `data` can carry it unchanged.
fn is_exact_json(data: &[u8]) -> bool {
    let trimmed = data
        .first()
        .is_some_and(|b| !b.is_ascii_whitespace() && *b != b'\xef')
        && data.last().is_some_and(|b| !b.is_ascii_whitespace());
    trimmed && serde_json::from_slice::<serde::de::IgnoredAny>(data).is_ok()
}

/// A JSON media type (`json-format.md` §3.1): `application/json`, `text/json`, or a
/// `+json` suffix, with any parameters; case-insensitive.
pub fn is_json_media_type(media_type: &str) -> bool {
    let essence = media_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let Some((kind, sub)) = essence.split_once('/') else {
        return false;
    };
    matches!(kind, "application" | "text") && (sub == "json" || sub.ends_with("+json"))
}

/// A CloudEvents media type (`application/cloudevents…`, case-insensitive): the mark of a
/// structured-mode message in every binding.
pub fn is_structured_media_type(media_type: &str) -> bool {
    media_type
        .trim_start()
        .get(..23)
        .is_some_and(|p| p.eq_ignore_ascii_case("application/cloudevents"))
}

/// A valid CloudEvents attribute name of at most [`MAX_NAME_LEN`] characters: `a-z`,
/// `0-9` (`spec.md`, "Attribute Naming Convention").
pub fn is_attribute_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// A character a CloudEvents String must not contain (`spec.md`, "Type System"): the
/// control characters U+0000-U+001F and U+007F-U+009F, Unicode noncharacters.
fn is_forbidden(c: char) -> bool {
    let u = u32::from(c);
    u <= 0x1f
        || (0x7f..=0x9f).contains(&u)
        || (0xfdd0..=0xfdef).contains(&u)
        || u & 0xfffe == 0xfffe
}

fn check_value(what: &str, value: &str) -> Result<(), PublishError> {
    match value.chars().find(|c| is_forbidden(*c)) {
        None => Ok(()),
        Some(c) => Err(refused(format!(
            "{what} contains U+{:04X}, which a CloudEvents attribute value must not (control characters and Unicode noncharacters)",
            u32::from(c)
        ))),
    }
}

/// RFC 3986 §4.1 URI-reference: non-empty, only the characters a URI may contain, every
/// `%` followed by two hex digits.
fn check_uri_reference(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("source must not be empty".into());
    }
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            if !(b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
            {
                return Err(format!(
                    "{s:?} is not a URI-reference: % must start a %XX escape"
                ));
            }
            i += 3;
            continue;
        }
        if !(c.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=".contains(&c)) {
            return Err(format!(
                "{s:?} is not a URI-reference (RFC 3986): percent-encode {:?}",
                char::from(c)
            ));
        }
        i += 1;
    }
    if s.contains("://") && url::Url::parse(s).is_err() {
        return Err(format!("{s:?} is not a valid absolute URI"));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use chrono::{DateTime, Utc};
    use uuid::Uuid;

    pub(super) fn message() -> OutgoingMessage {
        let mut headers = BTreeMap::new();
        headers.insert("content-type".into(), "application/json".into());
        headers.insert("correlation-id".into(), "req-7".into());
        headers.insert("causation-id".into(), "c-1".into());
        headers.insert(
            "traceparent".into(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        );
        headers.insert("tracestate".into(), "congo=t61rcWkgMzE".into());
        headers.insert("tenant".into(), "grüße ✓ 東京".into());
        headers.insert("subject".into(), "order/42".into());
        OutgoingMessage {
            id: 1,
            message_id: Uuid::now_v7(),
            topic: "orders.placed.v1".into(),
            key: Some("order 42".into()),
            payload: Bytes::from_static(br#"{"order":42}"#),
            headers,
            occurred_at: DateTime::parse_from_rfc3339("2026-11-30T10:11:12.123456Z")
                .unwrap()
                .with_timezone(&Utc),
            attempts: 1,
        }
    }

    pub(super) fn binary(mode: Mode) -> CloudEvents {
        CloudEvents::new(mode, "/shop/orders").unwrap()
    }

    #[test]
    fn attributes_are_mapped_in_order() {
        let m = message();
        let e = binary(Mode::Binary).event(&m).unwrap();
        let names: Vec<&str> = e.attributes.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "specversion",
                "id",
                "source",
                "type",
                "time",
                "subject",
                "partitionkey",
                "traceparent",
                "tracestate",
                "correlationid",
                "causationid",
                "tenant"
            ]
        );
        assert_eq!(e.attribute("id"), Some(m.message_id.to_string().as_str()));
        assert_eq!(e.attribute("type"), Some("orders.placed.v1"));
        assert_eq!(e.attribute("source"), Some("/shop/orders"));
        assert_eq!(e.attribute("time"), Some("2026-11-30T10:11:12.123456Z"));
        assert_eq!(e.attribute("datacontenttype"), Some("application/json"));
        assert_eq!(e.attribute("partitionkey"), Some("order 42"));
        assert_eq!(e.attribute("correlationid"), Some("req-7"));
        assert_eq!(e.attribute("message-id"), None);
        assert_eq!(e.data, m.payload);
    }

    #[test]
    fn headers_the_mapping_cannot_express_are_refused_permanently() {
        for (name, value, says) in [
            ("tenant-id", "x", "a-z and 0-9"),
            ("Tenant", "x", "a-z and 0-9"),
            ("averyveryverylongname1", "x", "1-20"),
            ("id", "x", "sets itself"),
            ("partitionkey", "x", "sets itself"),
            ("correlationid", "x", "sets itself"),
            ("data", "x", "sets itself"),
            ("tenant", "a\nb", "U+000A"),
            ("tenant", "a\u{85}b", "U+0085"),
            ("tenant", "a\u{fffe}", "U+FFFE"),
            ("content-type", "", "media type"),
            ("content-type", "text/plain; ä", "media type"),
            ("subject", "", "must not be"),
            ("dataschema", "schemas/order", "absolute URI"),
        ] {
            let mut m = message();
            m.headers.insert(name.into(), value.into());
            let e = binary(Mode::Binary).event(&m).unwrap_err();
            assert_eq!(e.kind, crate::error::ErrorKind::Permanent, "{name}");
            assert_eq!(e.code, "invalid_header", "{name}");
            assert!(e.message.contains(says), "{name}: {}", e.message);
        }
        let mut m = message();
        m.key = Some("k\u{1}".into());
        assert!(binary(Mode::Binary).event(&m).is_err());
        // A 20-character name, digits, and the optional core attributes are fine.
        let mut m = message();
        m.headers.insert("abcdefghij0123456789".into(), "v".into());
        m.headers
            .insert("dataschema".into(), "https://example.com/order.json".into());
        m.headers.insert("message-id".into(), "ignored".into());
        let e = binary(Mode::Binary).event(&m).unwrap();
        assert_eq!(e.attribute("abcdefghij0123456789"), Some("v"));
        assert_eq!(e.attribute("message-id"), None);
        // An empty key has no partitionkey (the extension requires a non-empty one).
        let mut m = message();
        m.key = Some(String::new());
        let e = binary(Mode::Binary).event(&m).unwrap();
        assert_eq!(e.attribute("partitionkey"), None);
    }

    #[test]
    fn url_parameters_select_the_envelope() {
        use EnvelopeFormat as F;
        assert_eq!(F::parse(Binding::Http, "", None, None), Ok(F::Outbox));
        assert_eq!(
            F::parse(Binding::Http, "", Some("outbox"), None),
            Ok(F::Outbox)
        );
        let ce = F::parse(Binding::Kafka, "", Some("cloudevents"), None).unwrap();
        assert_eq!(ce.cloudevents().unwrap().mode(), Mode::Binary);
        assert_eq!(ce.cloudevents().unwrap().source(), DEFAULT_SOURCE);
        let ce = F::parse(Binding::Nats, "", Some("cloudevents"), Some("urn:shop")).unwrap();
        assert_eq!(ce.cloudevents().unwrap().mode(), Mode::Structured);
        assert_eq!(ce.cloudevents().unwrap().source(), "urn:shop");
        let e = F::parse(Binding::Nats, "", Some("cloudevents-binary"), None).unwrap_err();
        assert!(e.contains("structured"), "{e}");
        let e = F::parse(Binding::Http, "outbox_", Some("ce"), None).unwrap_err();
        assert!(e.contains("outbox_envelope"), "{e}");
        let e = F::parse(Binding::Http, "outbox_", None, Some("/x")).unwrap_err();
        assert!(
            e.contains("outbox_ce_source needs outbox_envelope=cloudevents"),
            "{e}"
        );
        for bad in ["", "a b", "/x%zz", "http://[::1"] {
            assert!(
                F::parse(Binding::Mqtt, "", Some("cloudevents"), Some(bad)).is_err(),
                "{bad:?}"
            );
        }
        for good in [
            "/outbox",
            "urn:uuid:6e8bc430-9c3a-11d9-9669-0800200c9a66",
            "https://shop.example.com/orders",
            "orders%20svc",
        ] {
            assert!(
                F::parse(Binding::Mqtt, "", Some("cloudevents"), Some(good)).is_ok(),
                "{good:?}"
            );
        }
        assert!(F::refuse("Redis Streams", None, None).is_ok());
        assert!(F::refuse("Redis Streams", Some("outbox"), None).is_ok());
        let e = F::refuse("Redis Streams", Some("cloudevents"), None).unwrap_err();
        assert!(e.contains("no protocol binding for Redis Streams"), "{e}");
        assert!(F::refuse("Redis Streams", None, Some("/x")).is_err());
    }

    #[test]
    fn media_types() {
        assert!(is_json_media_type("application/json"));
        assert!(is_json_media_type("Application/JSON; charset=utf-8"));
        assert!(is_json_media_type("application/cloudevents+json"));
        assert!(is_json_media_type("text/json"));
        assert!(!is_json_media_type("application/jsonx"));
        assert!(!is_json_media_type("text/plain"));
        assert!(is_structured_media_type(
            "application/cloudevents+json; charset=UTF-8"
        ));
        assert!(is_structured_media_type("Application/CloudEvents+json"));
        assert!(!is_structured_media_type("application/json"));
    }
}
