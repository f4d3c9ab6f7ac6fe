//! Reading a CloudEvent back into an [`Envelope`]: the HTTP (and NATS) binding's value
//! encoding and its inverse, binary mode ([`from_binary`], [`is_binary`]) and the JSON
//! event format ([`from_structured`]). The `envelope::from_*` decoders read the CloudEvents
//! forms through these.

use super::{Binding, SPEC_VERSION, attr, is_json_media_type};
use crate::message::{Envelope, EnvelopeError, header};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use uuid::Uuid;

/// What the HTTP binding percent-encodes in a header value (§3.1.3.2): space, `"`, `%`
/// and the control characters; every byte outside ASCII is encoded by
/// [`percent_encoding::utf8_percent_encode`] whatever the set.
const HEADER_VALUE: &percent_encoding::AsciiSet =
    &percent_encoding::CONTROLS.add(b' ').add(b'"').add(b'%');

/// The HTTP binding's header value encoding (§3.1.3.2, also the NATS binding's): space,
/// `"`, `%` and every byte outside printable ASCII (U+0021-U+007E) as `%XX`, upper-case.
pub fn percent_encode(value: &str) -> String {
    percent_encoding::utf8_percent_encode(value, HEADER_VALUE).to_string()
}

/// The inverse of [`percent_encode`] as a receiver applies it (§3.1.3.2): a double-quoted
/// value is unquoted first (backslash escapes), then one round of percent-decoding; the
/// result must be UTF-8.
///
/// # Errors
/// [`EnvelopeError::NotUtf8`] naming `name`.
pub fn percent_decode(name: &str, value: &str) -> Result<String, EnvelopeError> {
    let unquoted;
    let value = match value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
        Some(inner) => {
            let mut s = String::with_capacity(inner.len());
            let mut chars = inner.chars();
            while let Some(c) = chars.next() {
                s.push(if c == '\\' {
                    chars.next().unwrap_or(c)
                } else {
                    c
                });
            }
            unquoted = s;
            unquoted.as_str()
        }
        None => value,
    };
    percent_encoding::percent_decode_str(value)
        .decode_utf8()
        .map(std::borrow::Cow::into_owned)
        .map_err(|_| EnvelopeError::NotUtf8(crate::message::snippet(name)))
}

/// Attributes read back, by name.
#[derive(Default)]
struct Collected {
    attributes: BTreeMap<String, String>,
}

impl Collected {
    fn push(&mut self, name: &str, value: String) -> Result<(), EnvelopeError> {
        if self.attributes.insert(name.to_owned(), value).is_some() {
            return Err(EnvelopeError::Repeated(crate::message::snippet(name)));
        }
        Ok(())
    }

    fn take(&mut self, name: &'static str) -> Result<String, EnvelopeError> {
        self.attributes
            .remove(name)
            .ok_or(EnvelopeError::Missing(name))
    }

    fn finish(mut self, payload: Bytes) -> Result<Envelope, EnvelopeError> {
        let invalid = |field: &str, value: &str, reason: &'static str| EnvelopeError::Invalid {
            field: field.into(),
            value: crate::message::snippet(value),
            reason,
        };
        let version = self.take(attr::SPECVERSION)?;
        if version != SPEC_VERSION {
            return Err(invalid(attr::SPECVERSION, &version, "not CloudEvents 1.0"));
        }
        let id = self.take(attr::ID)?;
        let message_id = Uuid::parse_str(&id)
            .map_err(|_| invalid(attr::ID, &id, "not a UUID (the outbox's message id)"))?;
        let source = self.take(attr::SOURCE)?;
        if source.is_empty() {
            return Err(invalid(attr::SOURCE, "", "empty"));
        }
        let topic = self.take(attr::TYPE)?;
        if topic.is_empty() {
            return Err(invalid(attr::TYPE, "", "empty"));
        }
        let time = self.take(attr::TIME)?;
        let occurred_at = DateTime::parse_from_rfc3339(&time)
            .map_err(|_| invalid(attr::TIME, &time, "not an RFC 3339 time"))?
            .with_timezone(&Utc);
        let key = self.attributes.remove(attr::PARTITIONKEY);
        let mut headers = BTreeMap::new();
        for (name, value) in self.attributes {
            let name = match name.as_str() {
                attr::DATACONTENTTYPE => header::CONTENT_TYPE.to_owned(),
                attr::CORRELATIONID => header::CORRELATION_ID.to_owned(),
                attr::CAUSATIONID => header::CAUSATION_ID.to_owned(),
                _ => name,
            };
            headers.insert(name, value);
        }
        Ok(Envelope {
            message_id,
            topic,
            key,
            occurred_at,
            headers,
            payload,
        })
    }
}

/// An envelope from a binary-mode message of `binding`: the transport's header or
/// property pairs (those without the binding's prefix are the transport's and left out;
/// every one for MQTT, which has no prefix), its content type (`datacontenttype`) and the
/// payload. Prefixes match ASCII-case-insensitively; AMQP also takes `cloudEvents_`;
/// values are percent-decoded for HTTP and NATS.
///
/// # Errors
/// [`EnvelopeError`]: a missing or invalid `specversion`, `id` (not a UUID), `source`,
/// `type` or `time`, a repeated attribute, a value that is not UTF-8.
pub fn from_binary<'a>(
    binding: Binding,
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    content_type: Option<&str>,
    payload: impl Into<Bytes>,
) -> Result<Envelope, EnvelopeError> {
    let mut c = Collected::default();
    for (name, value) in headers {
        let Some(attribute) = attribute_of(binding, name) else {
            continue;
        };
        let text = std::str::from_utf8(value)
            .map_err(|_| EnvelopeError::NotUtf8(crate::message::snippet(name)))?;
        let text = if binding.percent_encoded() {
            percent_decode(name, text)?
        } else {
            text.to_owned()
        };
        c.push(&attribute, text)?;
    }
    if let Some(ct) = content_type {
        // NATS carries it as `ce-datacontenttype`; MQTT may repeat it as a user property.
        match c.attributes.get(attr::DATACONTENTTYPE) {
            Some(existing) if existing != ct => {
                return Err(EnvelopeError::Repeated(attr::DATACONTENTTYPE.into()));
            }
            Some(_) => {}
            None => c.push(attr::DATACONTENTTYPE, ct.to_owned())?,
        }
    }
    c.finish(payload.into())
}

/// The attribute a binary-mode header or property name carries, if any.
fn attribute_of(binding: Binding, name: &str) -> Option<String> {
    let strip = |prefix: &str| {
        name.get(..prefix.len())
            .filter(|p| p.eq_ignore_ascii_case(prefix))
            .map(|_| name[prefix.len()..].to_ascii_lowercase())
    };
    match binding {
        Binding::Mqtt => Some(name.to_owned()),
        Binding::Amqp => strip("cloudEvents:").or_else(|| strip("cloudEvents_")),
        _ => strip(binding.prefix()),
    }
    .filter(|a| !a.is_empty())
}

/// Whether `names` hold a binary-mode CloudEvent of `binding` (a `specversion` under the
/// binding's prefix).
pub fn is_binary<'a>(binding: Binding, mut names: impl Iterator<Item = &'a str>) -> bool {
    names.any(|n| attribute_of(binding, n).as_deref() == Some(attr::SPECVERSION))
}

/// An envelope from a structured-mode message: the JSON event format. `data_base64` is
/// the payload's bytes; `data` is the payload as JSON text when `datacontenttype` is JSON
/// or absent (exactly as it appears in the event), the text of a JSON string otherwise.
/// Non-string attribute values (numbers, booleans) read as their canonical strings, `null`
/// as absent.
///
/// # Errors
/// [`EnvelopeError::Malformed`] for a body that is not a JSON object, an attribute that is
/// an object or array, both `data` and `data_base64`, invalid base64; else as
/// [`from_binary`].
pub fn from_structured(body: &[u8]) -> Result<Envelope, EnvelopeError> {
    let members: BTreeMap<String, Box<serde_json::value::RawValue>> = serde_json::from_slice(body)
        .map_err(|e| EnvelopeError::Malformed(format!("not a CloudEvents JSON event: {e}")))?;
    let mut c = Collected::default();
    let mut data = None;
    let mut data_base64 = None;
    for (name, raw) in members {
        match name.as_str() {
            "data" => data = Some(raw),
            "data_base64" => data_base64 = Some(raw),
            _ => {
                let value: serde_json::Value = serde_json::from_str(raw.get())
                    .map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
                let text = match value {
                    serde_json::Value::Null => continue,
                    serde_json::Value::String(s) => s,
                    serde_json::Value::Bool(b) => b.to_string(),
                    serde_json::Value::Number(n) => n.to_string(),
                    _ => {
                        return Err(EnvelopeError::Malformed(format!(
                            "attribute {} is not a string, number or boolean",
                            crate::message::snippet(&name)
                        )));
                    }
                };
                c.push(&name, text)?;
            }
        }
    }
    let payload = match (data, data_base64) {
        (Some(_), Some(_)) => {
            return Err(EnvelopeError::Malformed(
                "the event has both data and data_base64".into(),
            ));
        }
        (None, Some(b64)) => match serde_json::from_str::<Option<String>>(b64.get()) {
            Ok(None) => Bytes::new(),
            Ok(Some(s)) => Bytes::from(
                BASE64
                    .decode(s.as_bytes())
                    .map_err(|_| EnvelopeError::Malformed("data_base64 is not base64".into()))?,
            ),
            Err(_) => {
                return Err(EnvelopeError::Malformed(
                    "data_base64 is not a string".into(),
                ));
            }
        },
        (Some(raw), None) => {
            let json = c
                .attributes
                .get(attr::DATACONTENTTYPE)
                .is_none_or(|ct| is_json_media_type(ct));
            match serde_json::from_str::<serde_json::Value>(raw.get()) {
                Ok(serde_json::Value::Null) => Bytes::new(),
                Ok(serde_json::Value::String(s)) if !json => Bytes::from(s),
                _ => Bytes::copy_from_slice(raw.get().as_bytes()),
            }
        }
        (None, None) => Bytes::new(),
    };
    c.finish(payload)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::cloudevents::Mode;
    use crate::cloudevents::tests::{binary, message};

    #[test]
    fn http_values_are_percent_encoded_as_the_binding_says() {
        // The binding's own example (§3.1.3.2).
        assert_eq!(
            percent_encode("Euro \u{20ac} \u{1f600}"),
            "Euro%20%E2%82%AC%20%F0%9F%98%80"
        );
        assert_eq!(percent_encode("100% \"sure\""), "100%25%20%22sure%22");
        assert_eq!(percent_encode("/a/b?c=d"), "/a/b?c=d");
        // Control characters and DEL are encoded; the rest of printable ASCII is not.
        assert_eq!(percent_encode("\t\n\u{0}\u{7f}"), "%09%0A%00%7F");
        let printable: String = (0x21u8..=0x7e)
            .filter(|b| !matches!(b, b'"' | b'%'))
            .map(char::from)
            .collect();
        assert_eq!(percent_encode(&printable), printable);
        assert_eq!(
            percent_decode("x", "Euro%20%e2%82%ac%20%F0%9F%98%80").unwrap(),
            "Euro \u{20ac} \u{1f600}"
        );
        assert_eq!(percent_decode("x", r#""a \"b\" c""#).unwrap(), r#"a "b" c"#);
        // An overlong encoding of U+0020 is not UTF-8: rejected.
        assert_eq!(
            percent_decode("x", "%C0%A0"),
            Err(EnvelopeError::NotUtf8("x".into()))
        );
    }

    #[test]
    fn binary_mode_round_trips_through_every_binding() {
        let m = message();
        let e = binary(Mode::Binary).event(&m).unwrap();
        for binding in [Binding::Http, Binding::Kafka, Binding::Amqp, Binding::Mqtt] {
            let pairs = e.binary_headers(binding);
            let prefix = binding.prefix();
            assert!(pairs.iter().all(|(n, _)| n.starts_with(prefix)));
            assert!(is_binary(binding, pairs.iter().map(|(n, _)| n.as_str())));
            let env = from_binary(
                binding,
                pairs.iter().map(|(n, v)| (n.as_str(), v.as_bytes())),
                e.datacontenttype.as_deref(),
                m.payload.clone(),
            )
            .unwrap();
            assert_eq!(env.message_id, m.message_id, "{binding:?}");
            assert_eq!(env.topic, m.topic);
            assert_eq!(env.key, m.key);
            assert_eq!(env.occurred_at, m.occurred_at);
            assert_eq!(env.headers, m.headers, "{binding:?}");
            assert_eq!(env.payload, m.payload);
        }
        let http = e.binary_headers(Binding::Http);
        assert!(http.contains(&(
            "ce-tenant".into(),
            "gr%C3%BC%C3%9Fe%20%E2%9C%93%20%E6%9D%B1%E4%BA%AC".into()
        )));
        assert!(http.contains(&("ce-partitionkey".into(), "order%2042".into())));
        let kafka = e.binary_headers(Binding::Kafka);
        assert!(kafka.contains(&("ce_tenant".into(), "grüße ✓ 東京".into())));
        let amqp = e.binary_headers(Binding::Amqp);
        assert!(amqp.contains(&("cloudEvents:specversion".into(), "1.0".into())));
        // Read the other AMQP separator and upper-case HTTP names too.
        let renamed: Vec<(String, String)> = amqp
            .iter()
            .map(|(n, v)| (n.replace("cloudEvents:", "cloudEvents_"), v.clone()))
            .collect();
        let env = from_binary(
            Binding::Amqp,
            renamed.iter().map(|(n, v)| (n.as_str(), v.as_bytes())),
            None,
            Bytes::new(),
        )
        .unwrap();
        assert_eq!(env.message_id, m.message_id);
        let upper: Vec<(String, String)> = http
            .iter()
            .map(|(n, v)| (n.to_ascii_uppercase(), v.clone()))
            .collect();
        let env = from_binary(
            Binding::Http,
            upper.iter().map(|(n, v)| (n.as_str(), v.as_bytes())),
            None,
            Bytes::new(),
        )
        .unwrap();
        assert_eq!(env.header("tenant"), Some("grüße ✓ 東京"));
    }

    #[test]
    fn structured_mode_carries_json_as_data_and_the_rest_as_base64() {
        let mut m = message();
        let json = binary(Mode::Structured).event(&m).unwrap().to_json();
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v["data"], serde_json::json!({"order": 42}));
        assert_eq!(v["datacontenttype"], "application/json");
        assert_eq!(v["specversion"], "1.0");
        assert!(v.get("data_base64").is_none());
        let env = from_structured(&json).unwrap();
        assert_eq!(
            (env.message_id, &env.topic, &env.key, env.occurred_at),
            (m.message_id, &m.topic, &m.key, m.occurred_at)
        );
        assert_eq!(env.headers, m.headers);
        assert_eq!(env.payload, m.payload);
        for (ct, payload, member) in [
            ("application/json", &b"{\"a\":1}\n"[..], "data_base64"),
            ("application/json", b"not json", "data_base64"),
            ("application/vnd.x+json; charset=utf-8", b"[1, 2]", "data"),
            ("application/x-protobuf", &[0, 159, 255], "data_base64"),
            ("text/plain", "grüße".as_bytes(), "data_base64"),
        ] {
            m.headers.insert("content-type".into(), ct.into());
            m.payload = Bytes::copy_from_slice(payload);
            let json = binary(Mode::Structured).event(&m).unwrap().to_json();
            let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
            assert!(v.get(member).is_some(), "{ct}: {v}");
            let env = from_structured(&json).unwrap();
            assert_eq!(env.payload, m.payload, "{ct}");
            assert_eq!(env.content_type(), Some(ct));
        }
        // No content type, empty payload: neither member; reads back as no data.
        m.headers.remove("content-type");
        m.payload = Bytes::new();
        let json = binary(Mode::Structured).event(&m).unwrap().to_json();
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert!(v.get("data").is_none() && v.get("data_base64").is_none());
        let env = from_structured(&json).unwrap();
        assert!(env.payload.is_empty() && env.content_type().is_none());
    }

    #[test]
    fn other_producers_structured_events_are_read() {
        let id = Uuid::now_v7();
        let body = format!(
            r#"{{"specversion":"1.0","id":"{id}","source":"urn:x","type":"t.v1","time":"2026-01-02T03:04:05+01:00",
               "datacontenttype":"text/plain","data":"hello","retries":3,"flag":true,"gone":null}}"#
        );
        let env = from_structured(body.as_bytes()).unwrap();
        assert_eq!(env.payload, Bytes::from_static(b"hello"));
        assert_eq!(env.header("retries"), Some("3"));
        assert_eq!(env.header("flag"), Some("true"));
        assert_eq!(env.header("gone"), None);
        assert_eq!(env.occurred_at.to_rfc3339(), "2026-01-02T02:04:05+00:00");
        let without_type = body.replace(r#""type":"t.v1","#, "");
        assert_eq!(
            from_structured(without_type.as_bytes()),
            Err(EnvelopeError::Missing("type"))
        );
        let not_uuid = body.replace(&id.to_string(), "abc");
        assert!(matches!(
            from_structured(not_uuid.as_bytes()),
            Err(EnvelopeError::Invalid { ref field, .. }) if field == "id"
        ));
        let v03 = body.replace(r#""specversion":"1.0""#, r#""specversion":"0.3""#);
        assert!(matches!(
            from_structured(v03.as_bytes()),
            Err(EnvelopeError::Invalid { ref field, .. }) if field == "specversion"
        ));
        assert!(matches!(
            from_structured(b"[1]"),
            Err(EnvelopeError::Malformed(_))
        ));
    }
}
