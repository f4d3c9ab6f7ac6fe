//! The sink seam: where messages go, and what "confirmed" means for each.
//!
//! A sink publishes a batch and reports one outcome per message into the batch's
//! [`Confirmations`], as soon as each is known. `Ok(())` means the broker confirmed that
//! message (see each sink's docs for what its confirmation promises); an error says what
//! kind of failure it was ([`ErrorKind`]). A slot the sink never fills is never a success:
//! the relay reads it as "timed out" (when its deadline passed) or as "no outcome" (when
//! the sink returned without one), so no sink can turn a missing outcome into a dispatch.
//! Sinks never log payloads.

use crate::message::OutgoingMessage;
use async_trait::async_trait;
use std::fmt;

pub mod file;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "mqtt")]
pub mod mqtt;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
mod redis_client;
#[cfg(feature = "redis")]
pub mod redis_streams;
pub mod router;
#[cfg(feature = "redis")]
pub mod sidekiq;
#[cfg(feature = "tls")]
pub mod tls;

pub use crate::error::{
    CONTROL_TOPIC, ErrorKind, IN_FLIGHT, PublishCode, PublishError, TIMED_OUT_AFTER_SEND,
};

/// A sink URL that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// The URL's form is not one this build knows.
    #[error(
        "invalid sink URL {:?}: {reason} (expected stdout, file:PATH, nats://, kafka://, amqp://, redis://, sidekiq://, mqtt:// or http(s)://)",
        crate::redact::redact_url_without_query(url)
    )]
    InvalidUrl {
        /// The URL, redacted ([`crate::redact::redact_url`]; the message redacts it again,
        /// whoever built the error, and leaves out its query: a mistyped parameter's value
        /// may be a secret under a name that does not look like one, so the reason names
        /// parameters, never their values).
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A route's topic pattern that cannot be used ([`router::RouterBuilder::build`]).
    #[error("invalid route pattern {pattern:?}: {reason}")]
    InvalidPattern {
        /// The pattern as given.
        pattern: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The sink could not be opened (file not writable, …).
    #[error("cannot open sink {:?}: {source}", crate::redact::redact_url(url))]
    Open {
        /// The URL, redacted (as for [`SinkError::InvalidUrl`]).
        url: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// One message's outcome so far (`None` = not known yet).
pub(crate) type Slot = Option<Result<(), PublishError>>;

/// A batch's outcomes and when each was recorded, under one lock.
struct Slots {
    outcome: Vec<Slot>,
    at: Vec<Option<std::time::Instant>>,
    /// Messages the sink handed to the destination ([`Confirmations::mark_sent`]).
    sent: Vec<bool>,
}

/// One outcome slot per message of a batch: slot `i` belongs to `batch[i]`.
///
/// A sink fills a slot with [`Confirmations::set`] as soon as it knows that message's
/// outcome; the first outcome of a slot is final. The relay reads the slots when the
/// publish returns *or* when it stops waiting for it (the publish timeout, the shutdown
/// grace, a lost lease): every message confirmed by then is marked dispatched, whatever
/// happened to the others. A slot left empty is never a success. Cloning gives another
/// handle on the same slots.
#[derive(Clone)]
pub struct Confirmations {
    /// The outcomes, and when each was recorded (for the per-message confirmation latency).
    slots: std::sync::Arc<std::sync::Mutex<Slots>>,
    /// Woken whenever a slot is filled.
    filled: std::sync::Arc<tokio::sync::Notify>,
    /// For a view over part of a batch (a router's group): local index → batch index.
    map: Option<std::sync::Arc<[usize]>>,
}

impl Confirmations {
    /// `n` empty slots.
    pub fn new(n: usize) -> Self {
        Confirmations {
            slots: std::sync::Arc::new(std::sync::Mutex::new(Slots {
                outcome: vec![None; n],
                at: vec![None; n],
                sent: vec![false; n],
            })),
            filled: std::sync::Arc::new(tokio::sync::Notify::new()),
            map: None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn global(&self, i: usize) -> Option<usize> {
        match &self.map {
            Some(m) => m.get(i).copied(),
            None => Some(i),
        }
    }

    /// Number of slots (the batch's length).
    pub fn len(&self) -> usize {
        match &self.map {
            Some(m) => m.len(),
            None => self.lock().outcome.len(),
        }
    }

    /// True for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records message `i`'s outcome. Returns false (and changes nothing) when the slot
    /// already had one or `i` is out of range.
    pub fn set(&self, i: usize, outcome: Result<(), PublishError>) -> bool {
        self.fill(std::iter::once((i, outcome))) == 1
    }

    /// Records several outcomes under one lock with one wake-up (what
    /// [`Confirmations::set`] does for each, for outcomes known together). Slots that
    /// already had one, or are out of range, are left as they were.
    pub fn set_many(&self, outcomes: impl IntoIterator<Item = (usize, Result<(), PublishError>)>) {
        self.fill(outcomes);
    }

    /// Fills the empty slots among `outcomes` under one lock, wakes the waiters once if any
    /// was filled, and returns how many were.
    fn fill(&self, outcomes: impl IntoIterator<Item = (usize, Result<(), PublishError>)>) -> usize {
        let mut filled = 0;
        {
            let mut slots = self.lock();
            let now = std::time::Instant::now();
            for (i, outcome) in outcomes {
                let Some(g) = self.global(i) else { continue };
                if let Some(slot @ None) = slots.outcome.get_mut(g) {
                    *slot = Some(outcome);
                    slots.at[g] = Some(now);
                    filled += 1;
                }
            }
        }
        if filled > 0 {
            self.filled.notify_waiters();
        }
        filled
    }

    /// Records that message `i` was handed to the destination (written to a connection
    /// the client believes healthy). The router reads it when the message's timeout
    /// passes without an outcome: a message marked sent timed out after sending (the
    /// destination is slow), an unmarked one may never have left (an outage). See
    /// [`ErrorKind::TimedOut`]. A sink that fails fast when it cannot reach the
    /// destination may mark it when the send starts: the webhook sink does (a refused
    /// connection, DNS or TLS failure fills the slot with an unavailable error first; only
    /// a connect that hangs past the relay's timeout is then taken for slowness, which its
    /// connect timeout, at most 5 s, keeps short). Out of range: nothing.
    pub fn mark_sent(&self, i: usize) {
        if let Some(g) = self.global(i)
            && let Some(s) = self.lock().sent.get_mut(g)
        {
            *s = true;
        }
    }

    /// Whether message `i` was marked sent ([`Confirmations::mark_sent`]).
    pub fn was_sent(&self, i: usize) -> bool {
        self.global(i)
            .is_some_and(|g| self.lock().sent.get(g).copied().unwrap_or(false))
    }

    /// Records `error` for every message that has no outcome yet.
    pub fn fail_unset(&self, error: &PublishError) {
        let mut filled = false;
        self.update_each(|slot, at| {
            if slot.is_none() {
                *slot = Some(Err(error.clone()));
                *at = Some(std::time::Instant::now());
                filled = true;
            }
        });
        if filled {
            self.filled.notify_waiters();
        }
    }

    /// Calls `f` with each slot of this view and when its outcome was recorded, in order,
    /// under one lock (one lock per batch instead of one per message).
    pub(crate) fn update_each(
        &self,
        mut f: impl FnMut(&mut Slot, &mut Option<std::time::Instant>),
    ) {
        let mut slots = self.lock();
        let Slots { outcome, at, .. } = &mut *slots;
        match &self.map {
            Some(m) => {
                for &g in m.iter() {
                    if let (Some(o), Some(t)) = (outcome.get_mut(g), at.get_mut(g)) {
                        f(o, t);
                    }
                }
            }
            None => {
                for (o, t) in outcome.iter_mut().zip(at.iter_mut()) {
                    f(o, t);
                }
            }
        }
    }

    /// When each slot of the whole batch was recorded, empty ones as `None`.
    pub(crate) fn recorded_times(&self) -> Vec<Option<std::time::Instant>> {
        self.lock().at.clone()
    }

    /// When message `i`'s outcome was recorded.
    pub fn recorded_at(&self, i: usize) -> Option<std::time::Instant> {
        let g = self.global(i)?;
        self.lock().at.get(g).copied().flatten()
    }

    /// Message `i`'s outcome so far.
    pub fn get(&self, i: usize) -> Option<Result<(), PublishError>> {
        let g = self.global(i)?;
        self.lock().outcome.get(g).cloned().flatten()
    }

    /// How many messages were confirmed (`Ok`) so far.
    pub fn confirmed(&self) -> usize {
        let slots = self.lock();
        let ok = |g: &usize| matches!(slots.outcome.get(*g), Some(Some(Ok(()))));
        match &self.map {
            Some(m) => m.iter().filter(|g| ok(g)).count(),
            None => (0..slots.outcome.len()).filter(ok).count(),
        }
    }

    /// A view over the messages `indices` of this batch: its slot `j` is this one's slot
    /// `indices[j]` (how a router hands each destination its group).
    pub fn subset(&self, indices: &[usize]) -> Confirmations {
        let map: Vec<usize> = indices.iter().filter_map(|&i| self.global(i)).collect();
        Confirmations {
            slots: self.slots.clone(),
            filled: self.filled.clone(),
            map: Some(map.into()),
        }
    }

    /// True when every slot of this view has an outcome.
    pub fn is_complete(&self) -> bool {
        let slots = self.lock();
        match &self.map {
            Some(m) => m
                .iter()
                .all(|&g| slots.outcome.get(g).is_some_and(Option::is_some)),
            None => slots.outcome.iter().all(Option::is_some),
        }
    }

    /// Resolves once every slot of this view has an outcome.
    pub(crate) async fn complete(&self) {
        loop {
            let notified = self.filled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_complete() {
                return;
            }
            notified.await;
        }
    }

    /// Notified whenever a slot of the batch is filled (to follow outcomes as they come).
    #[cfg_attr(not(feature = "otel"), allow(dead_code))]
    pub(crate) fn filled(&self) -> &tokio::sync::Notify {
        &self.filled
    }

    /// Every slot of the whole batch, empty ones as `None`.
    pub(crate) fn snapshot(&self) -> Vec<Slot> {
        self.lock().outcome.clone()
    }
}

impl fmt::Debug for Confirmations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Confirmations")
            .field("len", &self.len())
            .field("confirmed", &self.confirmed())
            .finish()
    }
}

/// Where messages go. Implement it to add a broker.
#[async_trait]
pub trait Sink: Send + Sync + 'static {
    /// Publishes `batch` and records each message's outcome in `confirm` (slot `i` is
    /// `batch[i]`) as soon as it is known. Publishes should be pipelined: send all, then
    /// collect confirmations. Must not panic on any input. The caller may stop waiting
    /// (drop the future) at any time: what was recorded by then counts, empty slots do
    /// not count as confirmed.
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations);

    /// Publishes `batch` and returns its outcomes in order, waiting as long as the sink
    /// takes (no timeout): for tools and tests. A slot the sink left empty comes back as
    /// a transient "no outcome" error.
    async fn publish_all(&self, batch: &[OutgoingMessage]) -> Vec<Result<(), PublishError>> {
        let confirm = Confirmations::new(batch.len());
        self.publish(batch, &confirm).await;
        confirm
            .snapshot()
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(PublishError::transient("the sink gave no outcome"))))
            .collect()
    }

    /// How long the router waits for one publish of this sink, given the relay's publish
    /// timeout (`RelayConfig::publish_timeout`): that timeout, unless the sink bounds its
    /// own work otherwise (a job [`Handler`](crate::job::Handler) bounds each job by its
    /// own timeout and answers for the rest itself).
    fn publish_timeout(&self, relay: std::time::Duration) -> std::time::Duration {
        relay
    }

    /// What to change when this destination keeps taking messages and not answering in
    /// time (the router's "timed out after the request was sent" errors and warnings).
    fn slow_hint(&self) -> String {
        "if it is this slow, raise --publish-timeout-ms and the sink's own timeout (a webhook's outbox_timeout_ms)".to_owned()
    }

    /// Flushes and closes; called once when the relay stops.
    async fn close(&self) {}

    /// A short description for logs (no secrets).
    fn describe(&self) -> String;
}

/// Whether `query` names a CloudEvents parameter (`envelope`, `ce_source`).
fn has_envelope_param(query: &str) -> bool {
    url::form_urlencoded::parse(query.as_bytes()).any(|(k, _)| {
        k == crate::cloudevents::ENVELOPE_PARAM || k == crate::cloudevents::SOURCE_PARAM
    })
}

/// The query of a stdout or file URL: `envelope=outbox` and nothing else.
fn refuse_envelope(sink: &str, query: &str) -> Result<(), String> {
    let mut envelope = None;
    let mut source = None;
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            crate::cloudevents::ENVELOPE_PARAM => envelope = Some(v.into_owned()),
            crate::cloudevents::SOURCE_PARAM => source = Some(v.into_owned()),
            other => return Err(format!("unknown parameter {other:?} for {sink}")),
        }
    }
    crate::cloudevents::EnvelopeFormat::refuse(sink, envelope.as_deref(), source.as_deref())
}

/// Opens the sink named by `url`:
/// - `stdout`: JSON lines on standard output, confirmed once written and flushed;
/// - `file:PATH`: JSON lines appended to PATH, confirmed once flushed and `fsync`ed;
/// - `nats://HOST:PORT` or `tls://HOST:PORT`: NATS JetStream, confirmed by the PubAck
///   (feature `nats`);
/// - `kafka://HOST:PORT` or `kafkas://HOST:PORT` (TLS): Kafka, confirmed by the delivery
///   report (feature `kafka`);
/// - `amqp://…` or `amqps://…`: RabbitMQ, confirmed by the publisher confirm (feature
///   `rabbitmq`);
/// - `redis://…` or `rediss://…`: Redis Streams, confirmed by the `XADD` reply (feature
///   `redis`);
/// - `sidekiq://…?class=JobClass` or `sidekiqs://…`: a Sidekiq job per message on a
///   Sidekiq queue in Redis, confirmed by the `EXEC` reply (feature `redis`; module
///   `sidekiq`);
/// - `mqtt://…` or `mqtts://…`: MQTT 5, confirmed by PUBACK / PUBCOMP (feature `mqtt`);
/// - `http(s)://…`: a webhook, confirmed by a 2xx (feature `http`).
///
/// The network sinks take the same TLS and secret parameters (`ca=`, `cert=`, `key=`,
/// `password_file=`; [`tls`]) besides their own. NATS, Kafka, RabbitMQ, MQTT and webhooks
/// also take `envelope=cloudevents` (webhooks: `outbox_envelope=`) for a CloudEvents 1.0
/// envelope ([`crate::cloudevents`]); Redis Streams, Sidekiq, stdout and `file:` refuse it
/// (no CloudEvents protocol binding).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let e = outbox::sink::open("redis://127.0.0.1:6379?envelope=cloudevents").await;
/// assert!(matches!(e, Err(outbox::sink::SinkError::InvalidUrl { .. })));
/// # }
/// ```
///
/// # Errors
/// [`SinkError::InvalidUrl`] for an unknown or malformed URL, [`SinkError::Open`] when the
/// file cannot be opened.
///
#[cfg_attr(not(feature = "tls"), doc = "[`tls`]: crate#features")]
pub async fn open(url: &str) -> Result<Box<dyn Sink>, SinkError> {
    let invalid = |reason: &str| SinkError::InvalidUrl {
        url: crate::redact::redact_url(url),
        reason: reason.to_owned(),
    };
    if url == "stdout" || url == "stdout:" {
        return Ok(Box::new(file::FileSink::stdout()));
    }
    if let Some(query) = url
        .strip_prefix("stdout?")
        .or_else(|| url.strip_prefix("stdout:?"))
    {
        refuse_envelope("the stdout sink", query).map_err(|e| invalid(&e))?;
        return Ok(Box::new(file::FileSink::stdout()));
    }
    if let Some(path) = url.strip_prefix("file:") {
        let path = path.strip_prefix("//").unwrap_or(path);
        // `file:PATH?envelope=…`: a query naming the envelope is one, not part of the name.
        let path = match path.rsplit_once('?') {
            Some((p, query)) if has_envelope_param(query) => {
                refuse_envelope("the file sink", query).map_err(|e| invalid(&e))?;
                p
            }
            _ => path,
        };
        if path.is_empty() {
            return Err(invalid("file: needs a path"));
        }
        return Ok(Box::new(file::FileSink::open(path).await.map_err(|e| {
            SinkError::Open {
                url: crate::redact::redact_url(url),
                source: Box::new(e),
            }
        })?));
    }
    if url.starts_with("nats://") || url.starts_with("tls://") {
        #[cfg(feature = "nats")]
        return Ok(Box::new(
            nats::NatsSink::connect(url, nats::NatsOptions::default()).await?,
        ));
        #[cfg(not(feature = "nats"))]
        return Err(invalid("this build has no nats feature"));
    }
    if url.starts_with("kafka://") || url.starts_with("kafkas://") {
        #[cfg(feature = "kafka")]
        return Ok(Box::new(kafka::KafkaSink::connect(url).await?));
        #[cfg(not(feature = "kafka"))]
        return Err(invalid(
            "this build has no kafka feature (build with `--features kafka`; the outbox binary: `cargo build --release -p outbox-cli --features kafka`)",
        ));
    }
    if url.starts_with("amqp://") || url.starts_with("amqps://") {
        #[cfg(feature = "rabbitmq")]
        return Ok(Box::new(rabbitmq::RabbitMqSink::connect(url).await?));
        #[cfg(not(feature = "rabbitmq"))]
        return Err(invalid("this build has no rabbitmq feature"));
    }
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        #[cfg(feature = "redis")]
        return Ok(Box::new(
            redis_streams::RedisStreamsSink::connect(url).await?,
        ));
        #[cfg(not(feature = "redis"))]
        return Err(invalid("this build has no redis feature"));
    }
    if url.starts_with("sidekiq://") || url.starts_with("sidekiqs://") {
        #[cfg(feature = "redis")]
        return Ok(Box::new(sidekiq::SidekiqSink::connect(url).await?));
        #[cfg(not(feature = "redis"))]
        return Err(invalid("this build has no redis feature"));
    }
    if url.starts_with("mqtt://") || url.starts_with("mqtts://") {
        #[cfg(feature = "mqtt")]
        return Ok(Box::new(mqtt::MqttSink::connect(url).await?));
        #[cfg(not(feature = "mqtt"))]
        return Err(invalid("this build has no mqtt feature"));
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        #[cfg(feature = "http")]
        return Ok(Box::new(http::WebhookSink::connect(url).await?));
        #[cfg(not(feature = "http"))]
        return Err(invalid("this build has no http feature"));
    }
    // A mistyped scheme: what the URL's user name is cannot be known (NATS takes a token
    // there), so the whole userinfo is hidden.
    Err(SinkError::InvalidUrl {
        url: crate::redact::redact_unknown_url(url),
        reason: "unknown scheme".to_owned(),
    })
}
