//! A failed publish of one message: what kind of failure it is ([`ErrorKind`], and so what
//! the relay does with the message), its text for `last_error` and logs, and a bounded
//! reason code ([`PublishCode`]) for metrics and for code that acts on a failure.
//!
//! Vocabulary: no IO. Every sink reports with these types; [`crate::sink`] re-exports
//! them at their first home (`sink::PublishError`, `sink::ErrorKind`, …).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// What a failed publish says, and so what the relay does with the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// This message failed but may succeed later (a broker error about it, a nack): the
    /// relay reschedules it with backoff and the attempt counts towards `max_attempts`.
    Transient,
    /// Can never succeed as it is (too large, unroutable, refused): the relay quarantines.
    Permanent,
    /// The destination, not the message: not connected, refused the connection, rate
    /// limited (HTTP 429, a broker quota), out of service (HTTP 503), or confirmed nothing
    /// within the timeout. The relay gives the attempt back and reschedules the message
    /// for when the destination's circuit breaker next lets a publish through (or
    /// `retry_after`), so an outage, however long, never quarantines a healthy message.
    Unavailable,
    /// No confirmation for this message within its timeout (the sink's own, or the
    /// relay's). Whether that is the message's fault or the destination's is decided in
    /// one place ([`crate::sink::router`]): when the destination confirmed other
    /// messages meanwhile it is the message's (counted like [`ErrorKind::Transient`],
    /// quarantined eventually with a reason that says "timed out"). When it confirmed
    /// nothing, it depends on whether the message reached the destination: a timeout after
    /// sending (the sink's [`PublishError::timed_out_after_send`], or a slot marked with
    /// [`crate::sink::Confirmations::mark_sent`]) gets its attempt back only for the
    /// message's first [`crate::sink::router::TIMEOUT_REFUNDS`] such timeouts and counts
    /// from then on, so a destination that takes messages and never answers cannot be sent
    /// the same message without bound; a message not known to have been sent is an outage
    /// ([`ErrorKind::Unavailable`]).
    TimedOut,
}

/// The reason code of a failed publish ([`PublishError::code`]): a short, bounded name for
/// metrics (`outbox_publishes_total{reason}`) and for code that acts on a failure without
/// reading its text. [`PublishCode::as_str`] is the name; it is a metric label and is
/// written with the error, so a name never changes once given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PublishCode {
    /// `too_large`: the message exceeds what the destination takes.
    TooLarge,
    /// `no_destination`: no stream, topic or exchange to take it.
    NoDestination,
    /// `unroutable`: the broker had nowhere to route it.
    Unroutable,
    /// `invalid_topic`: the topic breaks a broker's character rules (a Redis glob
    /// character, a Kafka topic outside `[a-zA-Z0-9._-]`).
    InvalidTopic,
    /// `control_topic`: the topic addresses the broker's control plane or internal names
    /// ([`CONTROL_TOPIC`]).
    ControlTopic,
    /// `invalid_header`: a header the destination or the envelope cannot carry.
    InvalidHeader,
    /// `not_authorized`: the destination refused the credentials for this message.
    NotAuthorized,
    /// `rejected`: refused for what it is.
    Rejected,
    /// `nack`: the broker negatively acknowledged it.
    Nack,
    /// `wrong_type`: the destination key holds another type (a Redis key that is not a
    /// stream).
    WrongType,
    /// `rate_limited`: the destination asked to slow down (a quota).
    RateLimited,
    /// `http_4xx`: a webhook answered with a client error status.
    Http4xx,
    /// `http_5xx`: a webhook answered with a server error status.
    Http5xx,
    /// `http_other`: a webhook answered with a status that is neither a success nor an
    /// error (a redirect not followed).
    HttpOther,
    /// `not_connected`: the sink has no connection to the destination.
    NotConnected,
    /// `destination_down`: the destination is unreachable or refused the connection.
    DestinationDown,
    /// `destination_busy`: the destination is out of service for now.
    DestinationBusy,
    /// `io_error`: writing failed (the file sink).
    IoError,
    /// `timeout`: no confirmation in time ([`PublishError::timed_out`]).
    Timeout,
    /// `timed_out_after_send`: no answer in time to a message that was sent
    /// ([`TIMED_OUT_AFTER_SEND`], [`PublishError::timed_out_after_send`]).
    TimedOutAfterSend,
    /// `in_flight`: not sent, an earlier copy of the message is still outstanding
    /// ([`IN_FLIGHT`]).
    InFlight,
    /// `breaker_open`: not sent, the destination's circuit breaker is open (the router).
    BreakerOpen,
    /// `no_route`: no route matches the topic (the router).
    NoRoute,
    /// `no_outcome`: the sink returned without an outcome for the message (the router).
    NoOutcome,
    /// `handler_failed`: a job handler returned an error ([`crate::job`]).
    HandlerFailed,
    /// `handler_panicked`: a job handler panicked ([`crate::job`]).
    HandlerPanicked,
    /// `not_started`: not sent, the sink had no room to start it in time (a job handler at
    /// its concurrency limit, [`crate::job`]); given back, neutral for the breaker.
    NotStarted,
    /// `other`: no sink named a reason.
    Other,
}

impl PublishCode {
    /// Every code, in declaration order.
    pub const ALL: [PublishCode; 28] = [
        PublishCode::TooLarge,
        PublishCode::NoDestination,
        PublishCode::Unroutable,
        PublishCode::InvalidTopic,
        PublishCode::ControlTopic,
        PublishCode::InvalidHeader,
        PublishCode::NotAuthorized,
        PublishCode::Rejected,
        PublishCode::Nack,
        PublishCode::WrongType,
        PublishCode::RateLimited,
        PublishCode::Http4xx,
        PublishCode::Http5xx,
        PublishCode::HttpOther,
        PublishCode::NotConnected,
        PublishCode::DestinationDown,
        PublishCode::DestinationBusy,
        PublishCode::IoError,
        PublishCode::Timeout,
        PublishCode::TimedOutAfterSend,
        PublishCode::InFlight,
        PublishCode::BreakerOpen,
        PublishCode::NoRoute,
        PublishCode::NoOutcome,
        PublishCode::HandlerFailed,
        PublishCode::HandlerPanicked,
        PublishCode::NotStarted,
        PublishCode::Other,
    ];

    /// The code's name (`too_large`, `timed_out_after_send`, …): the metric label and
    /// the name kept with the error.
    pub const fn as_str(self) -> &'static str {
        match self {
            PublishCode::TooLarge => "too_large",
            PublishCode::NoDestination => "no_destination",
            PublishCode::Unroutable => "unroutable",
            PublishCode::InvalidTopic => "invalid_topic",
            PublishCode::ControlTopic => "control_topic",
            PublishCode::InvalidHeader => "invalid_header",
            PublishCode::NotAuthorized => "not_authorized",
            PublishCode::Rejected => "rejected",
            PublishCode::Nack => "nack",
            PublishCode::WrongType => "wrong_type",
            PublishCode::RateLimited => "rate_limited",
            PublishCode::Http4xx => "http_4xx",
            PublishCode::Http5xx => "http_5xx",
            PublishCode::HttpOther => "http_other",
            PublishCode::NotConnected => "not_connected",
            PublishCode::DestinationDown => "destination_down",
            PublishCode::DestinationBusy => "destination_busy",
            PublishCode::IoError => "io_error",
            PublishCode::Timeout => "timeout",
            PublishCode::TimedOutAfterSend => "timed_out_after_send",
            PublishCode::InFlight => "in_flight",
            PublishCode::BreakerOpen => "breaker_open",
            PublishCode::NoRoute => "no_route",
            PublishCode::NoOutcome => "no_outcome",
            PublishCode::HandlerFailed => "handler_failed",
            PublishCode::HandlerPanicked => "handler_panicked",
            PublishCode::NotStarted => "not_started",
            PublishCode::Other => "other",
        }
    }

    /// The code named `name` ([`PublishCode::as_str`]), if there is one.
    pub fn from_name(name: &str) -> Option<PublishCode> {
        PublishCode::ALL.into_iter().find(|c| c.as_str() == name)
    }
}

impl fmt::Display for PublishCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<str> for PublishCode {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for PublishCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<PublishCode> for &str {
    fn eq(&self, other: &PublishCode) -> bool {
        *self == other.as_str()
    }
}

impl AsRef<str> for PublishCode {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

/// The reason code of a timeout after the message was sent
/// ([`PublishError::timed_out_after_send`]), also once the router has judged it:
/// [`PublishCode::TimedOutAfterSend`]'s name.
pub const TIMED_OUT_AFTER_SEND: &str = PublishCode::TimedOutAfterSend.as_str();

/// The reason code of a message not sent because an earlier request or publish of the
/// same message to the same destination is still outstanding (the sink keeps at most one
/// copy of a message in flight); an [`ErrorKind::Unavailable`] with a `retry_after`:
/// [`PublishCode::InFlight`]'s name.
pub const IN_FLIGHT: &str = PublishCode::InFlight.as_str();

/// The [`PublishError::code`] of a message whose topic addresses its broker's control
/// plane or internal names ([`PublishCode::ControlTopic`]'s name): NATS subjects starting
/// with `$` (`$JS.`, `$SYS.`, `$KV.`, …) or `_INBOX.`, RabbitMQ `amq.` queue names on the
/// default exchange, Kafka topics starting with `__`, MQTT topics starting with `$`. Each
/// sink's module documentation gives its rule and the broker documentation it comes from.
///
/// Such a message is refused [permanently](ErrorKind::Permanent) before anything is sent
/// (also while the broker is down): the relay quarantines it as a dead letter whose reason
/// names the control topic; it is never published, retried or dropped. The rule is applied
/// to the name the sink actually puts on the wire (each sink sends the topic unchanged).
/// A topic that breaks a broker's character rules (a Redis glob character, a Kafka topic
/// outside `[a-zA-Z0-9._-]`) is `invalid_topic` instead.
///
/// Enqueue does not refuse these topics: [`crate::Message::validate`] and the SQL enqueue
/// functions know no broker, and a name one broker reserves is ordinary for another.
pub const CONTROL_TOPIC: &str = PublishCode::ControlTopic.as_str();

/// A failed publish of one message.
///
/// Equality compares kind, message, `retry_after` and code, not the source.
#[derive(Debug, Clone)]
pub struct PublishError {
    /// Transient or permanent.
    pub kind: ErrorKind,
    /// What failed, for `last_error` and logs (never the payload).
    pub message: String,
    /// The broker asked for at least this long before a retry (e.g. HTTP `Retry-After`).
    pub retry_after: Option<Duration>,
    /// A short, bounded reason code for metrics (`outbox_publishes_total{reason}`) and
    /// for code that acts on a failure without reading its text (see [`PublishCode`] for
    /// each). The sinks use: `too_large`, `no_destination` (no stream, topic, exchange),
    /// `unroutable`, `invalid_topic`, `control_topic` ([`CONTROL_TOPIC`]),
    /// `invalid_header`, `not_authorized`, `rejected` (refused for what it is), `nack`,
    /// `wrong_type`, `rate_limited`, `http_4xx`, `http_5xx`, `http_other`,
    /// `not_connected`, `destination_down`, `destination_busy`, `io_error`, `timeout`,
    /// `timed_out_after_send` ([`TIMED_OUT_AFTER_SEND`]), `in_flight` ([`IN_FLIGHT`]); the
    /// router adds `breaker_open`, `no_route`, `no_outcome`; job handlers ([`crate::job`])
    /// `handler_failed`, `handler_panicked`, `not_started`. `other` unless a sink names
    /// one ([`PublishError::with_code`]). Compares equal to its name
    /// (`e.code == "too_large"`).
    pub code: PublishCode,
    /// The underlying error, when the sink kept it ([`PublishError::with_source`]); its
    /// text is already part of `message` where it says something useful.
    pub source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl PublishError {
    fn new(kind: ErrorKind, message: impl Into<String>, code: PublishCode) -> Self {
        PublishError {
            kind,
            message: message.into(),
            retry_after: None,
            code,
            source: None,
        }
    }

    /// A transient error.
    pub fn transient(message: impl Into<String>) -> Self {
        PublishError::new(ErrorKind::Transient, message, PublishCode::Other)
    }

    /// A permanent error.
    pub fn permanent(message: impl Into<String>) -> Self {
        PublishError::new(ErrorKind::Permanent, message, PublishCode::Other)
    }

    /// The destination is unreachable (see [`ErrorKind::Unavailable`]).
    pub fn unavailable(message: impl Into<String>) -> Self {
        PublishError::new(ErrorKind::Unavailable, message, PublishCode::Other)
    }

    /// No confirmation in time (see [`ErrorKind::TimedOut`]). Code `timeout`.
    pub fn timed_out(message: impl Into<String>) -> Self {
        PublishError::new(ErrorKind::TimedOut, message, PublishCode::Timeout)
    }

    /// No answer in time to a message the destination was sent: the request was written
    /// to an established connection (the connection, DNS and TLS had succeeded) and the
    /// answer did not come within the timeout. The destination is reachable but slow; the
    /// router counts it as the message's (after its first
    /// [`crate::sink::router::TIMEOUT_REFUNDS`] such timeouts) instead of as an outage.
    /// Code [`TIMED_OUT_AFTER_SEND`].
    pub fn timed_out_after_send(message: impl Into<String>) -> Self {
        PublishError::new(ErrorKind::TimedOut, message, PublishCode::TimedOutAfterSend)
    }

    /// True for a timeout after the message was sent
    /// ([`PublishError::timed_out_after_send`]).
    pub fn is_timeout_after_send(&self) -> bool {
        self.code == PublishCode::TimedOutAfterSend
    }

    /// A message refused because its `topic` addresses the broker's control plane
    /// ([`CONTROL_TOPIC`]): permanent, with a reason naming the topic and `why` (which
    /// names are reserved, and for what).
    pub fn control_topic(topic: &str, why: &str) -> Self {
        PublishError::permanent(format!(
            "topic {topic:?} is a control topic, refused without sending: {why}"
        ))
        .with_code(PublishCode::ControlTopic)
    }

    /// The same error, asking for at least `after` before the next try.
    #[must_use]
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The same error with the reason code `code` (bounded: it becomes a metric label).
    #[must_use]
    pub fn with_code(mut self, code: PublishCode) -> Self {
        self.code = code;
        self
    }

    /// The same error with `source` as its cause ([`std::error::Error::source`]). The
    /// message is unchanged.
    #[must_use]
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The outcome label of `outbox_publishes_total`: `transient`, `permanent`,
    /// `unavailable` or `timed_out`.
    pub fn outcome(&self) -> &'static str {
        match self.kind {
            ErrorKind::Transient => "transient",
            ErrorKind::Permanent => "permanent",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::TimedOut => "timed_out",
        }
    }

    /// True unless [`ErrorKind::Permanent`]: a retry may work.
    pub fn is_transient(&self) -> bool {
        !matches!(self.kind, ErrorKind::Permanent)
    }
}

impl PartialEq for PublishError {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind
            && self.message == other.message
            && self.retry_after == other.retry_after
            && self.code == other.code
    }
}

impl Eq for PublishError {}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            ErrorKind::Transient => "transient",
            ErrorKind::Permanent => "permanent",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::TimedOut => "timed out",
        };
        write!(f, "{kind}: {}", self.message)
    }
}

impl std::error::Error for PublishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names are persisted and are metric labels: each is unique and round-trips.
    #[test]
    fn codes_have_unique_names_that_round_trip() {
        let mut names: Vec<&str> = PublishCode::ALL.iter().map(|c| c.as_str()).collect();
        for c in PublishCode::ALL {
            assert_eq!(PublishCode::from_name(c.as_str()), Some(c));
            assert_eq!(c, c.as_str());
            assert_eq!(c.to_string(), c.as_str());
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), PublishCode::ALL.len());
        assert_eq!(TIMED_OUT_AFTER_SEND, "timed_out_after_send");
        assert_eq!(IN_FLIGHT, "in_flight");
        assert_eq!(CONTROL_TOPIC, "control_topic");
        assert_eq!(PublishCode::from_name("nope"), None);
    }

    #[test]
    fn constructors_keep_their_codes() {
        assert_eq!(PublishError::transient("x").code, "other");
        assert_eq!(PublishError::timed_out("x").code, "timeout");
        assert!(PublishError::timed_out_after_send("x").is_timeout_after_send());
        let e = PublishError::control_topic("$SYS.x", "reserved");
        assert_eq!(
            (e.kind, e.code),
            (ErrorKind::Permanent, PublishCode::ControlTopic)
        );
    }

    #[test]
    fn the_source_is_the_cause_and_not_compared() {
        use std::error::Error as _;
        let io = std::io::Error::other("disk full");
        let e = PublishError::unavailable("write failed").with_source(io);
        assert_eq!(
            e.source().map(|s| s.to_string()).as_deref(),
            Some("disk full")
        );
        assert_eq!(e, PublishError::unavailable("write failed"));
        assert_eq!(e.to_string(), "unavailable: write failed");
    }
}
