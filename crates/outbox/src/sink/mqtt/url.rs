//! The sink URL: scheme, host and port, the MQTT user name and password from its
//! userinfo, and its query parameters (`qos`, `client_id`, `max_inflight`, `envelope`,
//! `ce_source`).

use super::{MQTT_MAX_STRING, is_mqtt_string};
use crate::cloudevents::{Binding, ENVELOPE_PARAM, EnvelopeFormat, SOURCE_PARAM};
use rumqttc::v5::mqttbytes::QoS;

/// What the URL says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct MqttUrl {
    pub(super) tls: bool,
    /// An IPv6 address in brackets.
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
    pub(super) qos: QoS,
    pub(super) client_id: Option<String>,
    pub(super) max_inflight: u16,
    pub(super) envelope: EnvelopeFormat,
}

pub(super) fn parse_url(url: &str) -> Result<MqttUrl, String> {
    let tls = if url.starts_with("mqtt://") {
        false
    } else if url.starts_with("mqtts://") {
        true
    } else {
        return Err("the scheme must be mqtt:// or mqtts://".into());
    };
    if url.contains('#') {
        return Err("a fragment (#…) has no meaning here".into());
    }
    // The url crate's errors name what is wrong, never the text (no userinfo).
    let u = ::url::Url::parse(url).map_err(|e| e.to_string())?;
    if !matches!(u.path(), "" | "/") {
        return Err("the URL has a path; the topic comes from each message".into());
    }
    let host = match u.host() {
        None => return Err("the URL has no host".into()),
        Some(::url::Host::Domain("")) => return Err("the URL has no host".into()),
        // In brackets, as an MQTT client takes it.
        Some(::url::Host::Ipv6(addr)) => format!("[{addr}]"),
        // Not a special scheme: the host is opaque, percent-encoded where not ASCII.
        Some(::url::Host::Domain(name)) => percent_decode(name)?,
        Some(::url::Host::Ipv4(addr)) => addr.to_string(),
    };
    let port = match u.port() {
        None => {
            if tls {
                8883
            } else {
                1883
            }
        }
        Some(0) => return Err("port \"0\" is not a number in 1-65535".into()),
        Some(p) => p,
    };
    // A user name when the URL has userinfo (`:PASS@` alone is an empty user name).
    let (username, password) = match (u.username(), u.password()) {
        ("", None) => (None, None),
        (name, pw) => (
            Some(percent_decode(name)?),
            pw.map(percent_decode).transpose()?,
        ),
    };
    let mut parsed = MqttUrl {
        tls,
        host,
        port,
        username,
        password,
        qos: QoS::AtLeastOnce,
        client_id: None,
        max_inflight: 100,
        envelope: EnvelopeFormat::Outbox,
    };
    let mut envelope = None;
    let mut source = None;
    // Split here rather than by `query_pairs`: a `+` in an MQTT parameter is a `+`.
    for pair in u.query().unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v)?;
        match k {
            "qos" => {
                parsed.qos = match v.as_str() {
                    "1" => QoS::AtLeastOnce,
                    "2" => QoS::ExactlyOnce,
                    "0" => {
                        return Err(
                            "qos=0 has no acknowledgement, so nothing could confirm a message: use 1 or 2"
                                .into(),
                        );
                    }
                    other => return Err(format!("qos must be 1 or 2, got {other:?}")),
                }
            }
            "client_id" => {
                if v.is_empty() || v.len() > MQTT_MAX_STRING || !is_mqtt_string(&v) {
                    return Err("client_id must be 1-65535 bytes of printable UTF-8".into());
                }
                parsed.client_id = Some(v);
            }
            "max_inflight" => {
                parsed.max_inflight = v
                    .parse::<u16>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("max_inflight must be 1-65535, got {v:?}"))?;
            }
            ENVELOPE_PARAM => envelope = Some(v),
            SOURCE_PARAM => source = Some(v),
            other => {
                return Err(format!(
                    "unknown parameter {other:?} (known: qos, client_id, max_inflight, envelope, ce_source)"
                ));
            }
        }
    }
    parsed.envelope =
        EnvelopeFormat::parse(Binding::Mqtt, "", envelope.as_deref(), source.as_deref())?;
    Ok(parsed)
}

/// `s` percent-decoded: every `%` must begin a `%XX` escape (the `percent-encoding` crate
/// would keep a stray one as it is), and what the escapes spell must be UTF-8.
fn percent_decode(s: &str) -> Result<String, String> {
    let stray = s.split('%').skip(1).any(|after| {
        !after
            .as_bytes()
            .get(..2)
            .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    if stray {
        return Err("invalid percent-encoding in the URL".into());
    }
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .map(std::borrow::Cow::into_owned)
        .map_err(|_| "percent-encoding in the URL is not UTF-8".to_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_with_defaults_and_options() {
        let u = parse_url("mqtt://127.0.0.1:1883").unwrap();
        assert_eq!(
            (u.tls, u.host.as_str(), u.port, u.qos, u.max_inflight),
            (false, "127.0.0.1", 1883, QoS::AtLeastOnce, 100)
        );
        assert_eq!(parse_url("mqtt://broker").unwrap().port, 1883);
        assert_eq!(parse_url("mqtts://broker/").unwrap().port, 8883);
        let u =
            parse_url("mqtt://us%40er:p%3Ass@[::1]:1884?qos=2&client_id=relay-1&max_inflight=7")
                .unwrap();
        assert_eq!(u.host, "[::1]");
        assert_eq!(u.port, 1884);
        assert_eq!(u.username.as_deref(), Some("us@er"));
        assert_eq!(u.password.as_deref(), Some("p:ss"));
        assert_eq!(u.qos, QoS::ExactlyOnce);
        assert_eq!(u.client_id.as_deref(), Some("relay-1"));
        assert_eq!(u.max_inflight, 7);
        assert_eq!(u.envelope, EnvelopeFormat::Outbox);
        let u = parse_url("mqtt://h?envelope=cloudevents&ce_source=urn%3Ashop").unwrap();
        let ce = u.envelope.cloudevents().unwrap();
        assert_eq!(
            (ce.mode(), ce.source()),
            (crate::cloudevents::Mode::Binary, "urn:shop")
        );
        // A `+` is itself; a stray `%` and escapes that are not UTF-8 are refused.
        let u = parse_url("mqtt://:p%2B+@h?client_id=a+b%2Fc").unwrap();
        assert_eq!(u.client_id.as_deref(), Some("a+b/c"));
        assert_eq!(
            (u.username.as_deref(), u.password.as_deref()),
            (Some(""), Some("p++"))
        );
        assert_eq!(parse_url("mqtt://u@h").unwrap().password, None);
        assert_eq!(parse_url("mqtt://h").unwrap().username, None);
        assert_eq!(
            parse_url("mqtt://h?client_id=a%zz").unwrap_err(),
            "invalid percent-encoding in the URL"
        );
        assert_eq!(
            parse_url("mqtt://u:%FF@h").unwrap_err(),
            "percent-encoding in the URL is not UTF-8"
        );
        assert_eq!(
            parse_url("mqtt://h:0").unwrap_err(),
            "port \"0\" is not a number in 1-65535"
        );
        assert_eq!(
            parse_url("mqtt://h#x").unwrap_err(),
            "a fragment (#…) has no meaning here"
        );
        for bad in [
            "mqtt://h?envelope=cloud",
            "mqtt://h?ce_source=%2Fx",
            "mqtt://h?envelope=cloudevents&ce_source=a%20b",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
        for bad in [
            "http://x",
            "mqtt://",
            "mqtt://h:0",
            "mqtt://h:99999",
            "mqtt://h/topic",
            "mqtt://h?qos=0",
            "mqtt://h?qos=3",
            "mqtt://h?max_inflight=0",
            "mqtt://h?client_id=",
            "mqtt://h?colour=red",
            "mqtt://[::1",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}
