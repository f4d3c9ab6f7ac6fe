//! A message checked against what MQTT can carry and turned into what rumqttc sends:
//! control topics and topic names MQTT cannot publish to are refused, the envelope
//! becomes user properties and the Content Type property.

use super::{MQTT_MAX_STRING, is_mqtt_string};
use crate::cloudevents::{Binding, EnvelopeFormat};
use crate::message::OutgoingMessage;
use crate::sink::{PublishCode, PublishError};
use rumqttc::v5::mqttbytes::v5::PublishProperties;

/// Why `topic` cannot be an MQTT topic name to publish to, if it cannot.
fn topic_problem(topic: &str) -> Option<&'static str> {
    if topic.is_empty() {
        Some("it is empty")
    } else if topic.contains(['+', '#']) {
        Some("MQTT topic names cannot contain the wildcards + or #")
    } else if topic.len() > MQTT_MAX_STRING {
        Some("it is longer than 65,535 bytes")
    } else if !is_mqtt_string(topic) {
        Some("it contains NUL, control characters or Unicode non-characters")
    } else {
        None
    }
}

/// A message checked and turned into what rumqttc sends.
pub(super) struct Prepared {
    pub(super) properties: PublishProperties,
    pub(super) payload: bytes::Bytes,
}

/// The permanent [`CONTROL_TOPIC`](crate::sink::CONTROL_TOPIC) error of a topic starting
/// with `$`: MQTT v5 §4.7.2 reserves those for the server (`$SYS/`), and a broker may give
/// them a meaning of its own (`$share/` shared subscriptions, Mosquitto's `$CONTROL/`).
pub(super) fn control_topic_error(topic: &str) -> Option<PublishError> {
    topic.starts_with('$').then(|| {
        PublishError::control_topic(
            topic,
            "MQTT topics starting with $ are the broker's ($SYS/ statistics and control, $share/ shared subscriptions; MQTT v5 §4.7.2)",
        )
    })
}

pub(super) fn prepare(
    m: &OutgoingMessage,
    envelope: &EnvelopeFormat,
) -> Result<Prepared, PublishError> {
    if let Some(e) = control_topic_error(&m.topic) {
        return Err(e);
    }
    if let Some(why) = topic_problem(&m.topic) {
        return Err(PublishError::permanent(format!(
            "topic {:?} is not a valid MQTT topic name: {why}",
            m.topic
        ))
        .with_code(PublishCode::InvalidTopic));
    }
    // The user properties, the Content Type property and the payload.
    let (pairs, content_type, payload) = envelope.properties(m, Binding::Mqtt)?;
    if let Some(ct) = &content_type
        && (ct.len() > MQTT_MAX_STRING || !is_mqtt_string(ct))
    {
        return Err(PublishError::permanent(
            "the content type cannot be an MQTT string (NUL, control characters, Unicode non-characters, or over 65,535 bytes)",
        )
        .with_code(PublishCode::InvalidHeader));
    }
    let mut user_properties = Vec::with_capacity(pairs.len());
    for (name, value) in pairs {
        for (what, text) in [("name", name.as_str()), ("value", value.as_str())] {
            if text.len() > MQTT_MAX_STRING || !is_mqtt_string(text) {
                return Err(PublishError::permanent(format!(
                    "header {name:?}: the {what} cannot be an MQTT string (NUL, control characters, Unicode non-characters, or over 65,535 bytes)"
                )).with_code(PublishCode::InvalidHeader));
            }
        }
        user_properties.push((name, value));
    }
    Ok(Prepared {
        properties: PublishProperties {
            user_properties,
            content_type,
            ..PublishProperties::default()
        },
        payload,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn topics_mqtt_cannot_publish_to_are_refused() {
        assert_eq!(topic_problem("orders.order-placed.v1"), None);
        assert_eq!(topic_problem("a/b/grüße"), None);
        for bad in ["", "a/+/b", "a/#", "a\0b", "a\u{7}b", "a\u{ffff}"] {
            assert!(topic_problem(bad).is_some(), "{bad:?}");
        }
        for control in ["$SYS/x", "$share/g/t", "$"] {
            let e = control_topic_error(control).unwrap();
            assert_eq!(e.code, crate::sink::CONTROL_TOPIC, "{e}");
            assert_eq!(e.kind, crate::sink::ErrorKind::Permanent, "{e}");
        }
        assert!(control_topic_error("a/$SYS").is_none());
    }
}
