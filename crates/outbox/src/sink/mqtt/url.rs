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
    /// As written (an IPv6 address keeps its brackets).
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
    let (tls, rest) = if let Some(r) = url.strip_prefix("mqtt://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("mqtts://") {
        (true, r)
    } else {
        return Err("the scheme must be mqtt:// or mqtts://".into());
    };
    if rest.contains('#') {
        return Err("a fragment (#…) has no meaning here".into());
    }
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = before_query.split_once('/').unwrap_or((before_query, ""));
    if !path.is_empty() {
        return Err("the URL has a path; the topic comes from each message".into());
    }
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (addr, after) = v6
            .split_once(']')
            .ok_or_else(|| "an IPv6 address needs a closing ]".to_owned())?;
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| "expected :PORT after the IPv6 address".to_owned())?,
            ),
        };
        (format!("[{addr}]"), port)
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (hostport.to_owned(), None),
        }
    };
    if host.is_empty() || host == "[]" {
        return Err("the URL has no host".into());
    }
    let port = match port {
        None => {
            if tls {
                8883
            } else {
                1883
            }
        }
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("port {p:?} is not a number in 1-65535"))?,
    };
    let (username, password) = match userinfo {
        None => (None, None),
        Some(u) => match u.split_once(':') {
            Some((name, pw)) => (Some(percent_decode(name)?), Some(percent_decode(pw)?)),
            None => (Some(percent_decode(u)?), None),
        },
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
    for pair in query.split('&').filter(|p| !p.is_empty()) {
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

fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| "invalid percent-encoding in the URL".to_owned())?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "percent-encoding in the URL is not UTF-8".to_owned())
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
