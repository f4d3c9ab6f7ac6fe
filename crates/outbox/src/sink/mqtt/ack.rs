//! What a PUBACK or PUBREC reason code means for its message (MQTT v5 §3.4.2.1,
//! §3.5.2.1): a success, or a permanent, transient or unavailable failure.

use crate::sink::{PublishCode, PublishError};
use rumqttc::v5::mqttbytes::v5::{PubAckReason, PubRecReason};

/// A PUBACK/PUBREC reason code, as one type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AckReason {
    Success,
    NoMatchingSubscribers,
    UnspecifiedError,
    ImplementationSpecificError,
    NotAuthorized,
    TopicNameInvalid,
    PacketIdentifierInUse,
    QuotaExceeded,
    PayloadFormatInvalid,
}

impl From<PubAckReason> for AckReason {
    fn from(r: PubAckReason) -> Self {
        match r {
            PubAckReason::Success => AckReason::Success,
            PubAckReason::NoMatchingSubscribers => AckReason::NoMatchingSubscribers,
            PubAckReason::UnspecifiedError => AckReason::UnspecifiedError,
            PubAckReason::ImplementationSpecificError => AckReason::ImplementationSpecificError,
            PubAckReason::NotAuthorized => AckReason::NotAuthorized,
            PubAckReason::TopicNameInvalid => AckReason::TopicNameInvalid,
            PubAckReason::PacketIdentifierInUse => AckReason::PacketIdentifierInUse,
            PubAckReason::QuotaExceeded => AckReason::QuotaExceeded,
            PubAckReason::PayloadFormatInvalid => AckReason::PayloadFormatInvalid,
        }
    }
}

impl From<PubRecReason> for AckReason {
    fn from(r: PubRecReason) -> Self {
        match r {
            PubRecReason::Success => AckReason::Success,
            PubRecReason::NoMatchingSubscribers => AckReason::NoMatchingSubscribers,
            PubRecReason::UnspecifiedError => AckReason::UnspecifiedError,
            PubRecReason::ImplementationSpecificError => AckReason::ImplementationSpecificError,
            PubRecReason::NotAuthorized => AckReason::NotAuthorized,
            PubRecReason::TopicNameInvalid => AckReason::TopicNameInvalid,
            PubRecReason::PacketIdentifierInUse => AckReason::PacketIdentifierInUse,
            PubRecReason::QuotaExceeded => AckReason::QuotaExceeded,
            PubRecReason::PayloadFormatInvalid => AckReason::PayloadFormatInvalid,
        }
    }
}

/// `None` for a success; else the error for the message (MQTT v5 §3.4.2.1 / §3.5.2.1).
pub(super) fn ack_failure(
    reason: AckReason,
    reason_string: Option<String>,
) -> Option<PublishError> {
    let (code, what, permanent) = match reason {
        AckReason::Success | AckReason::NoMatchingSubscribers => return None,
        AckReason::UnspecifiedError => (0x80, "unspecified error", false),
        AckReason::ImplementationSpecificError => (0x83, "implementation specific error", false),
        AckReason::NotAuthorized => (0x87, "not authorized", true),
        AckReason::TopicNameInvalid => (0x90, "topic name invalid", true),
        AckReason::PacketIdentifierInUse => (0x91, "packet identifier in use", false),
        AckReason::QuotaExceeded => (0x97, "quota exceeded", false),
        AckReason::PayloadFormatInvalid => (0x99, "payload format invalid", true),
    };
    let mut text = format!("the MQTT broker refused the publish: {code:#04x} {what}");
    if let Some(s) = reason_string.filter(|s| !s.is_empty()) {
        text.push_str(&format!(" ({s})"));
    }
    let code = match reason {
        AckReason::NotAuthorized => PublishCode::NotAuthorized,
        AckReason::TopicNameInvalid => PublishCode::InvalidTopic,
        AckReason::QuotaExceeded => PublishCode::RateLimited,
        AckReason::PayloadFormatInvalid => PublishCode::Rejected,
        _ => PublishCode::Nack,
    };
    Some(
        match (reason, permanent) {
            // 0x97 Quota exceeded (§3.4.2.1: "An implementation or administrative imposed
            // limit has been exceeded"): the broker's pressure, not the message.
            (AckReason::QuotaExceeded, _) => PublishError::unavailable(text),
            (_, true) => PublishError::permanent(text),
            (_, false) => PublishError::transient(text),
        }
        .with_code(code),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn reason_codes_classify() {
        assert!(ack_failure(AckReason::Success, None).is_none());
        assert!(ack_failure(AckReason::NoMatchingSubscribers, None).is_none());
        for r in [
            AckReason::NotAuthorized,
            AckReason::TopicNameInvalid,
            AckReason::PayloadFormatInvalid,
        ] {
            assert!(!ack_failure(r, None).unwrap().is_transient(), "{r:?}");
        }
        assert_eq!(
            ack_failure(AckReason::QuotaExceeded, None).unwrap().kind,
            crate::sink::ErrorKind::Unavailable
        );
        for r in [
            AckReason::UnspecifiedError,
            AckReason::ImplementationSpecificError,
            AckReason::PacketIdentifierInUse,
        ] {
            let e = ack_failure(r, Some("busy".into())).unwrap();
            assert_eq!(e.kind, crate::sink::ErrorKind::Transient, "{r:?}");
            assert!(e.message.contains("(busy)"));
        }
        assert!(
            ack_failure(AckReason::QuotaExceeded, None)
                .unwrap()
                .message
                .contains("0x97")
        );
    }
}
