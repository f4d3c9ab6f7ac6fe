//! Redis Streams sink (the `redis` crate, one multiplexed connection).
//!
//! URL: `redis://[USER:PASS@]HOST:PORT[/DB][?maxlen=N][&max_message_bytes=N]`. `maxlen`
//! trims every stream to about N entries (`MAXLEN ~ N`: Redis trims whole macro nodes,
//! so a stream may keep somewhat more). `rediss://` is TLS: the system's roots are trusted,
//! or, when a `ca=PATH` bundle is given (or `OUTBOX_TLS_CA_FILE` is set), that bundle
//! instead of them; `cert=PATH&key=PATH` is the client identity and `password_file=PATH`
//! the password (see [`super::tls`]). An ACL user authenticates as `USER:PASS@`. The
//! `protocol` parameter is passed on to the client; anything else is refused.
//!
//! - Stream key = topic. Each message becomes one entry:
//!   `XADD <topic> [MAXLEN ~ N] * message_id <uuid> topic <topic> key <key, or empty when
//!   none> occurred_at <RFC 3339, microseconds, UTC> headers <JSON object of the stored
//!   headers (correlation id, trace context, content type, user headers), string values>
//!   payload <the payload bytes, unchanged>`.
//! - The stream key is the topic unchanged (no prefix), and the sink writes no other key:
//!   there is no key of the relay's own a topic could overwrite. A topic that Redis would
//!   read as more than a name is refused permanently with the code `invalid_topic`,
//!   before anything is sent and also while the server is down: one with a glob character
//!   (`*`, `?`, `[`, `]`, `\`: the pattern syntax of `KEYS`, `SCAN … MATCH`, `PSUBSCRIBE`
//!   and ACL key patterns, <https://redis.io/docs/latest/commands/keys/>,
//!   <https://redis.io/docs/latest/operate/oss_and_stack/management/security/acl/#key-permissions>),
//!   which an operator's or consumer's pattern would match as something else, or one with
//!   a control character (C0, DEL, C1: line breaks split the inline commands of
//!   `redis-cli` and logs, <https://redis.io/docs/latest/develop/reference/protocol-spec/#inline-commands>).
//!   Message texts never reach a Redis command as anything but a bulk string.
//! - The `message_id` field is the consumer's deduplication key: Redis 7.0 (the server
//!   here) has no idempotent XADD, so a re-publish after a crash between confirmation and
//!   mark appends a second entry with the same `message_id`.
//! - Confirmed = the XADD reply (the new entry id). By default Redis replies once the
//!   entry is in memory, before any fsync: with `appendonly yes` and `appendfsync everysec` (the
//!   default) a crash can lose the last second or two of confirmed entries; only
//!   `appendfsync always` fsyncs before replying
//!   (<https://redis.io/docs/latest/operate/oss_and_stack/management/persistence/>). The
//!   server on this machine runs with no persistence at all (`--save "" --appendonly no`):
//!   a restart loses every stream. Replicas do not help either unless the producer
//!   `WAIT`s, which this sink does not do.
//! - A batch is one pipeline, one round trip; each reply is mapped on its own. `WRONGTYPE`
//!   (the key exists and is not a stream), `NOPERM` (an ACL forbids the key) and a message
//!   over `max_message_bytes` (default 512 MiB, Redis's `proto-max-bulk-len`) are
//!   [permanent](super::ErrorKind::Permanent), and the rest of the batch still goes
//!   through. `NOAUTH` (no password in the URL), `OOM`, `LOADING`, `BUSY`, `MISCONF`,
//!   `READONLY`, `MASTERDOWN`, `TRYAGAIN`, cluster redirects (this sink speaks to one
//!   standalone server), no connection and timeouts are
//!   [unavailable](super::ErrorKind::Unavailable) (the server cannot take anything now; the
//!   relay gives the attempt back); any other error is transient.
//! - Connection: made lazily and kept. A server that is down at
//!   [`RedisStreamsSink::connect`] does not fail it; each batch retries the connection. A
//!   connection that failed or timed out is dropped and re-made on the next batch.
//!
//! Payloads never appear in logs; [`Sink::describe`] omits the credentials.

use super::redis_client::{RedisServer, classify_reply, split_url};
use super::{Confirmations, PublishCode, PublishError, Sink, SinkError};
use crate::message::{OutgoingMessage, header};
use crate::redact::redact_url as redact;
use async_trait::async_trait;
use redis::{RedisResult, Value};
use std::time::Duration;

/// Redis's default `proto-max-bulk-len`, the largest single argument it accepts, in bytes
/// (512 MiB).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 512 * 1024 * 1024;

/// Settings of the Redis Streams sink; [`RedisStreamsSink::connect`] reads them from the
/// URL.
#[derive(Debug, Clone)]
pub struct RedisStreamsOptions {
    /// Trim each stream to about this many entries (`MAXLEN ~ N`); `None` keeps all.
    pub maxlen: Option<u64>,
    /// Largest [`OutgoingMessage::size`] sent, in bytes (default
    /// [`DEFAULT_MAX_MESSAGE_BYTES`]); larger messages are permanent failures.
    pub max_message_bytes: usize,
    /// Bound on making the connection (default 5 s).
    pub connect_timeout: Duration,
    /// Bound on one batch's pipeline reply (default 8 s, below the relay's default publish
    /// timeout of 10 s); a timeout reports the batch unavailable and replaces the
    /// connection.
    pub response_timeout: Duration,
}

impl Default for RedisStreamsOptions {
    fn default() -> Self {
        RedisStreamsOptions {
            maxlen: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(8),
        }
    }
}

/// Appends each message to the Redis stream named like its topic.
pub struct RedisStreamsSink {
    server: RedisServer,
    options: RedisStreamsOptions,
    describe: String,
}

impl std::fmt::Debug for RedisStreamsSink {
    /// The description only, as logs show it: no credentials (see [`Sink::describe`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RedisStreamsSink")
            .field(&self.describe())
            .finish()
    }
}

impl RedisStreamsSink {
    /// Reads `url` (see the module docs) and tries to connect. A server that cannot be
    /// reached is not an error here: it is logged, and each batch retries the connection.
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] when the URL cannot be parsed, carries an unknown parameter
    /// or names a TLS file that cannot be read; [`SinkError::Open`] when the TLS handshake
    /// fails (an untrusted or expired certificate, a wrong host name) or the server refuses
    /// the credentials at start.
    pub async fn connect(url: &str) -> Result<Self, SinkError> {
        let (_, options) = parse_url(url)?;
        Self::connect_with(url, options).await
    }

    /// As [`RedisStreamsSink::connect`], with settings given in code (`maxlen` and
    /// `max_message_bytes` in the URL, if any, are replaced by `options`).
    ///
    /// # Errors
    /// As [`RedisStreamsSink::connect`].
    pub async fn connect_with(url: &str, options: RedisStreamsOptions) -> Result<Self, SinkError> {
        let (parts, _) = parse_url(url)?;
        let server = RedisServer::open(
            url,
            &parts,
            options.connect_timeout,
            options.response_timeout,
            &redact(url),
        )
        .await?;
        let describe = format!(
            "{}{}",
            server.address,
            options
                .maxlen
                .map_or(String::new(), |n| format!(" maxlen ~{n}"))
        );
        Ok(RedisStreamsSink {
            server,
            options,
            describe,
        })
    }

    fn xadd(&self, pipe: &mut redis::Pipeline, m: &OutgoingMessage) {
        let headers = serde_json::Value::Object(
            m.envelope_headers()
                .into_iter()
                .filter(|(name, _)| !header::RESERVED.contains(name))
                .map(|(name, value)| (name.to_owned(), serde_json::Value::String(value)))
                .collect(),
        );
        let cmd = pipe.cmd("XADD").arg(&m.topic);
        if let Some(n) = self.options.maxlen {
            cmd.arg("MAXLEN").arg("~").arg(n);
        }
        cmd.arg("*")
            .arg("message_id")
            .arg(m.message_id.to_string())
            .arg("topic")
            .arg(&m.topic)
            .arg("key")
            .arg(m.key.as_deref().unwrap_or(""))
            .arg("occurred_at")
            .arg(
                m.occurred_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            )
            .arg("headers")
            .arg(headers.to_string())
            .arg("payload")
            .arg(&m.payload[..]);
    }
}

#[async_trait]
impl Sink for RedisStreamsSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        if batch.is_empty() {
            return;
        }
        let mut out: Vec<Option<Result<(), PublishError>>> = vec![None; batch.len()];
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        let mut sent = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            // Refused before anything is sent, and recorded at once: permanent even when
            // the server cannot be reached below.
            if let Some(why) = topic_problem(&m.topic) {
                confirm.set(
                    i,
                    Err(PublishError::permanent(format!(
                        "topic {:?} cannot be a Redis stream key: {why}",
                        m.topic
                    ))
                    .with_code(PublishCode::InvalidTopic)),
                );
                continue;
            }
            let size = m.size();
            if size > self.options.max_message_bytes {
                out[i] = Some(Err(PublishError::permanent(format!(
                    "message of {size} bytes (payload, topic, key and headers) exceeds the Redis limit of {} bytes",
                    self.options.max_message_bytes
                )).with_code(PublishCode::TooLarge)));
                continue;
            }
            self.xadd(&mut pipe, m);
            sent.push(i);
        }
        if !sent.is_empty() {
            let mut conn = match self.server.connection().await {
                Ok(c) => c,
                Err(e) => {
                    // What was decided without the server stays (a message too large is
                    // permanent); the rest is unavailable.
                    for (i, r) in out.into_iter().enumerate() {
                        if let Some(r) = r {
                            confirm.set(i, r);
                        }
                    }
                    confirm.fail_unset(&e);
                    return;
                }
            };
            match pipe.query_async::<Vec<RedisResult<Value>>>(&mut conn).await {
                Ok(replies) if replies.len() == sent.len() => {
                    for (i, reply) in sent.iter().zip(replies) {
                        out[*i] = Some(match reply {
                            Ok(Value::BulkString(_) | Value::SimpleString(_)) => Ok(()),
                            Ok(other) => Err(PublishError::transient(format!(
                                "unexpected XADD reply {other:?}"
                            ))
                            .with_code(PublishCode::Other)),
                            Err(e) => Err(classify_xadd(&e, &batch[*i].topic)),
                        });
                    }
                }
                Ok(replies) => {
                    let e = PublishError::transient(format!(
                        "Redis returned {} replies for {} XADDs",
                        replies.len(),
                        sent.len()
                    ))
                    .with_code(PublishCode::Other);
                    for i in &sent {
                        out[*i] = Some(Err(e.clone()));
                    }
                }
                Err(e) => {
                    // No usable reply at all: the entries may or may not have been added (a
                    // retry can duplicate them; consumers deduplicate on message_id).
                    self.server.reset().await;
                    let e = PublishError::unavailable(format!(
                        "Redis pipeline to {} failed: {e}",
                        self.describe
                    ))
                    .with_code(PublishCode::NotConnected);
                    for i in &sent {
                        out[*i] = Some(Err(e.clone()));
                    }
                }
            }
        }
        for (i, r) in out.into_iter().enumerate() {
            if let Some(r) = r {
                confirm.set(i, r);
            }
        }
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// Why `topic` cannot be a stream key, if it cannot: a glob character (`*`, `?`, `[`,
/// `]`, `\`) or a control character (see the module docs).
fn topic_problem(topic: &str) -> Option<&'static str> {
    if topic.contains(['*', '?', '[', ']', '\\']) {
        Some(
            "it contains a glob character (* ? [ ] \\), which KEYS, SCAN MATCH, PSUBSCRIBE and ACL key patterns read as a pattern",
        )
    } else if topic.chars().any(char::is_control) {
        Some("it contains a control character")
    } else {
        None
    }
}

/// What one failed XADD means.
fn classify_xadd(e: &redis::RedisError, topic: &str) -> PublishError {
    classify_reply(
        e,
        &format!("XADD to {topic:?}"),
        format!(
            "Redis key {topic:?} exists and is not a stream (WRONGTYPE): rename or delete that key, or use another topic"
        ),
    )
}

/// Splits our parameters off `url`: the parts the client gets and the options.
fn parse_url(url: &str) -> Result<(super::redis_client::RedisUrl, RedisStreamsOptions), SinkError> {
    let invalid = |reason: String| SinkError::InvalidUrl {
        url: redact(url),
        reason,
    };
    let parts = split_url(url, "redis", "rediss")?;
    let mut options = RedisStreamsOptions::default();
    let mut envelope = None;
    let mut source = None;
    for (k, v) in &parts.params {
        let positive = |what: &str| {
            v.parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| invalid(format!("{what} {v:?} is not a positive integer")))
        };
        match k.as_str() {
            "maxlen" => options.maxlen = Some(positive("maxlen")?),
            "max_message_bytes" => {
                options.max_message_bytes = usize::try_from(positive("max_message_bytes")?)
                    .map_err(|_| invalid(format!("max_message_bytes {v:?} is too large")))?;
            }
            crate::cloudevents::ENVELOPE_PARAM => envelope = Some(v.clone()),
            crate::cloudevents::SOURCE_PARAM => source = Some(v.clone()),
            k => {
                return Err(invalid(format!(
                    "unknown parameter {k:?} (known: maxlen, max_message_bytes, protocol)"
                )));
            }
        }
    }
    crate::cloudevents::EnvelopeFormat::refuse(
        "Redis Streams",
        envelope.as_deref(),
        source.as_deref(),
    )
    .map_err(invalid)?;
    Ok((parts, options))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn glob_and_control_characters_cannot_name_a_stream() {
        for ok in ["orders.placed", "orders:eu/v1", "a{tag}b", "grüße"] {
            assert_eq!(topic_problem(ok), None, "{ok}");
        }
        for bad in [
            "o*", "o?", "o[a]", "o]", "o\\x", "a\nb", "a\rb", "a\u{7f}", "a\u{85}",
        ] {
            assert!(topic_problem(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn url_parameters_are_split_off() {
        let (u, o) = parse_url("redis://:pw@127.0.0.1:6379/3?maxlen=1000").unwrap();
        assert_eq!(u.client_url, "redis://:pw@127.0.0.1:6379/3");
        assert_eq!(o.maxlen, Some(1000));
        let (u, o) = parse_url("redis://h:1?protocol=resp3&max_message_bytes=10").unwrap();
        assert_eq!(u.client_url, "redis://h:1?protocol=resp3");
        assert_eq!(o.maxlen, None);
        assert_eq!(o.max_message_bytes, 10);
        assert!(parse_url("redis://h?maxlen=0").is_err());
        assert!(parse_url("redis://h?maxln=5").is_err());
        let (u, _) = parse_url("rediss://h:6380?ca=/etc/ca.pem&maxlen=5").unwrap();
        assert_eq!(u.client_url, "rediss://h:6380");
        assert_eq!(
            u.files.ca.as_deref(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
        assert_eq!(redact("redis://u:secret@h:1/0"), "redis://u:***@h:1/0");
    }
}
