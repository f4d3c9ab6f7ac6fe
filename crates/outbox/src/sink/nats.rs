//! NATS JetStream sink (async-nats).
//!
//! - Subject = topic. Every publish carries `Nats-Msg-Id` = message id, so the stream's
//!   duplicate window drops a re-publish after a crash between confirmation and mark
//!   (<https://docs.nats.io/using-nats/developer/develop_jetstream/model_deep_dive#message-deduplication>).
//! - Confirmed = the stream's PubAck (a `duplicate: true` PubAck is a success too). Note:
//!   a PubAck means the stream stored the message; whether it was fsynced first depends on
//!   the server's `sync_interval` (NATS 2.9 defaults to syncing every 2 minutes; set
//!   `sync_interval: always` in the server's `jetstream` block for fsync-before-ack).
//! - Envelope headers: `message-id`, `topic`, `key`, `occurred-at`, then the stored headers.
//! - Errors: a subject that no stream covers, a message over the server's `max_payload`,
//!   a header NATS cannot carry (CR/LF), a topic that is not a publishable subject are
//!   permanent; no connection, an acknowledgement timeout or a broken pipe mean the
//!   server is unavailable (the message keeps its attempts); anything else is transient.

use super::{PublishError, Sink, SinkError};
use crate::message::OutgoingMessage;
use crate::redact::{redact_url, scrub};
use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_trait::async_trait;
use futures::future::join_all;
use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

/// How long [`NatsSink::connect`] waits for the first connection before it returns anyway
/// (and logs one warning naming the redacted URL).
pub const INITIAL_CONNECT_WAIT: Duration = Duration::from_secs(2);

/// Settings of the NATS sink.
#[derive(Debug, Clone)]
pub struct NatsOptions {
    /// How long to wait for each PubAck (and for JetStream API calls). Keep it below the
    /// relay's lease.
    pub ack_timeout: Duration,
}

impl Default for NatsOptions {
    fn default() -> Self {
        NatsOptions {
            ack_timeout: Duration::from_secs(5),
        }
    }
}

/// Publishes to NATS JetStream and waits for each PubAck.
pub struct NatsSink {
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    describe: String,
}

impl NatsSink {
    /// Connects to `url` (`nats://HOST:PORT`, optionally `nats://user:pass@HOST:PORT`).
    /// The connection is made in the background and kept alive: a server that is down at
    /// start makes publishes report the destination unavailable until it is up (their
    /// attempts are given back); it does not fail the relay.
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] when the URL cannot be parsed.
    pub async fn connect(url: &str, options: NatsOptions) -> Result<Self, SinkError> {
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .max_reconnects(None)
            // Reconnect quickly after a broker restart: 50 ms doubling to at most 1 s.
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis(50u64.saturating_mul(1 << attempts.min(5)))
                    .min(Duration::from_secs(1))
            })
            .connection_timeout(Duration::from_secs(2))
            .connect(url)
            .await
            .map_err(|e| SinkError::InvalidUrl {
                url: redact_url(url),
                reason: scrub(&e.to_string(), url),
            })?;
        let js = async_nats::jetstream::ContextBuilder::new()
            .timeout(options.ack_timeout)
            .build(client.clone());
        let sink = NatsSink {
            client,
            js,
            describe: redact_url(url),
        };
        // Give the first connection a moment, so the first batch does not find it still
        // being made; a server that is down is not an error here, but it is said once.
        if !sink.connected_within(INITIAL_CONNECT_WAIT).await {
            tracing::warn!(sink = %sink.describe, wait = ?INITIAL_CONNECT_WAIT, "NATS not reachable yet; the connection keeps retrying in the background");
        }
        Ok(sink)
    }

    /// Waits up to `wait` for the connection (a reconnect in progress usually completes
    /// in milliseconds); false when still not connected.
    async fn connected_within(&self, wait: Duration) -> bool {
        use async_nats::connection::State;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if self.client.connection_state() == State::Connected {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The underlying client (for tests and administration).
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    fn headers(m: &OutgoingMessage) -> Result<HeaderMap, PublishError> {
        let mut h = HeaderMap::new();
        for (name, value) in m.envelope_headers() {
            let n = async_nats::HeaderName::from_str(name).map_err(|_| {
                PublishError::permanent(format!("header name {name:?} is not valid in NATS"))
            })?;
            let v = async_nats::HeaderValue::from_str(&value).map_err(|_| {
                PublishError::permanent(format!(
                    "header {name:?} has a value NATS cannot carry (CR or LF)"
                ))
            })?;
            h.insert(n, v);
        }
        Ok(h)
    }

    /// Is `subject` really covered by no stream? Asks the JetStream API, so that a server
    /// still starting up (which also answers "no responders") counts as transient.
    async fn confirm_no_stream(&self, subject: &str) -> PublishError {
        use async_nats::jetstream::context::GetStreamByNameErrorKind as K;
        match self.js.stream_by_subject(subject).await {
            Err(e) if matches!(e.kind(), K::NotFound) => PublishError::permanent(format!(
                "no JetStream stream covers subject {subject:?}: create a stream whose subjects include it"
            )),
            Err(e) if matches!(e.kind(), K::InvalidSubject) => {
                PublishError::permanent(format!("{subject:?} is not a valid NATS subject"))
            }
            Ok(_) => {
                PublishError::transient(format!("stream for subject {subject:?} did not answer"))
            }
            Err(e) => PublishError::transient(format!("JetStream unavailable: {e}")),
        }
    }
}

#[async_trait]
impl Sink for NatsSink {
    async fn publish(&self, batch: &[OutgoingMessage]) -> Vec<Result<(), PublishError>> {
        if !self.connected_within(Duration::from_millis(500)).await {
            let e = PublishError::unavailable(format!("not connected to {}", self.describe));
            return vec![Err(e); batch.len()];
        }
        // Send every publish first (pipelined), then collect the PubAcks.
        let mut pending = Vec::with_capacity(batch.len());
        for m in batch {
            if !is_publishable_subject(&m.topic) {
                pending.push(Err(Err_::Classified(PublishError::permanent(format!(
                    "topic {:?} is not a valid NATS subject: dot-separated non-empty tokens, no whitespace, no wildcards",
                    m.topic
                )))));
                continue;
            }
            let sent = match Self::headers(m) {
                Err(e) => Err(Err_::Classified(e)),
                Ok(headers) => {
                    let msg = PublishMessage::build()
                        .payload(m.payload.clone())
                        .headers(headers)
                        .message_id(m.message_id.to_string());
                    self.js
                        .send_publish(m.topic.clone(), msg)
                        .await
                        .map_err(|e| classify(e.kind(), e.to_string(), &m.topic))
                }
            };
            pending.push(sent);
        }
        let acks = join_all(pending.into_iter().zip(batch).map(|(sent, m)| async move {
            match sent {
                Err(e) => Err(e),
                Ok(ack) => ack
                    .await
                    .map(|_| ())
                    .map_err(|e| classify(e.kind(), e.to_string(), &m.topic)),
            }
        }))
        .await;
        let mut out = Vec::with_capacity(batch.len());
        let mut no_stream: HashMap<&str, PublishError> = HashMap::new();
        for (m, r) in batch.iter().zip(acks) {
            out.push(match r {
                Ok(()) => Ok(()),
                Err(Err_::Classified(e)) => Err(e),
                Err(Err_::NoStream) => {
                    if !no_stream.contains_key(m.topic.as_str()) {
                        let e = self.confirm_no_stream(&m.topic).await;
                        no_stream.insert(m.topic.as_str(), e);
                    }
                    Err(no_stream[m.topic.as_str()].clone())
                }
            });
        }
        out
    }

    async fn close(&self) {
        // Every publish was already acknowledged or abandoned; a flush only matters while
        // connected, and must not wait for a server that is down.
        if self.client.connection_state() == async_nats::connection::State::Connected {
            let _ = tokio::time::timeout(Duration::from_secs(2), self.client.flush()).await;
        }
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// A subject a publish may use (<https://docs.nats.io/nats-concepts/subjects>): tokens
/// separated by `.`, none empty, no whitespace or control characters, no `*` / `>`
/// wildcard tokens.
fn is_publishable_subject(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|t| {
            !t.is_empty()
                && t != "*"
                && t != ">"
                && !t.chars().any(|c| c.is_whitespace() || c.is_control())
        })
}

/// A publish error, or "no stream answered", which needs a JetStream API call to tell a
/// missing stream (permanent) from a server still starting (transient).
enum Err_ {
    Classified(PublishError),
    NoStream,
}

fn classify(kind: PublishErrorKind, text: String, topic: &str) -> Err_ {
    match kind {
        PublishErrorKind::MaxPayloadExceeded => Err_::Classified(PublishError::permanent(format!(
            "message on {topic:?} exceeds the NATS server's max_payload: {text}"
        ))),
        PublishErrorKind::StreamNotFound => Err_::NoStream,
        // No acknowledgement at all: the server or stream is not answering, which says
        // nothing about the message.
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
            Err_::Classified(PublishError::unavailable(format!("NATS publish: {text}")))
        }
        // Too many acks pending and anything unexpected are transient.
        _ => Err_::Classified(PublishError::transient(format!("NATS publish: {text}"))),
    }
}
