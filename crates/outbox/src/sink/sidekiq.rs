//! Sidekiq sink: each message becomes a Sidekiq job in Sidekiq's own Redis format, for the
//! job engine that Ruby services (and the other languages speaking its protocol) already
//! run.
//!
//! URL: `sidekiq://[USER:PASS@]HOST:PORT[/DB]?class=JobClass[&queue=NAME][&retry=true|false|N][&max_message_bytes=N]`.
//! `class` is required: the worker class Sidekiq instantiates (a Ruby constant path such
//! as `Mailers::WelcomeJob` for Sidekiq itself). `queue` defaults to `default`, Sidekiq's
//! default queue. `retry` is the job's `retry` field (default `true`: Sidekiq retries a
//! failing job with its own backoff and then moves it to its dead set; `false` never; a
//! number, at most that many times). `sidekiqs://` is TLS; TLS files, `password_file` and
//! ACL users are as for the Redis Streams sink ([`super::redis_streams`]). Routing by
//! topic pattern picks the queue and class: one route (`--route 'emails.>=sidekiq://…'`)
//! per queue and class.
//!
//! - The job is the JSON hash Sidekiq's client writes
//!   (<https://github.com/sidekiq/sidekiq/wiki/Job-Format>): `class`, `args`, `jid`,
//!   `queue`, `retry`, `created_at` (the message's occurred-at) and `enqueued_at` (when the
//!   relay pushed it), both in epoch seconds as floats, the unit of Sidekiq 6 and 7.
//! - `args` is `[payload, envelope]`. The payload is its JSON value when the message's
//!   `content-type` is JSON (`application/json`, `…+json`) or, with no `content-type`,
//!   when it parses as JSON; otherwise it is a string (UTF-8), or, for bytes that are not
//!   UTF-8, their base64 with `"payload_encoding": "base64"` in the envelope. A payload
//!   whose `content-type` says JSON and that does not parse is refused permanently. The
//!   envelope is `{"message_id", "topic", "key" (null without one), "occurred_at" (RFC
//!   3339), "headers" (the stored headers, string values)}`.
//! - `jid` is the message id as 32 lowercase hex digits (the UUID without its dashes):
//!   a redelivery of the same message has the same `jid`, so a worker (or Sidekiq's
//!   unique-jobs middleware) can recognise it. Sidekiq's own `jid`s are 24 hex digits;
//!   nothing in Sidekiq reads their length.
//! - A batch is one `MULTI` … `EXEC`: `SADD queues NAME` (Sidekiq's registry of queues,
//!   which its Web UI and `Sidekiq::Queue.all` read) and one `LPUSH queue:NAME` of every
//!   job, oldest first at the right end, where Sidekiq's `BRPOP` takes from. Sidekiq's
//!   client pushes the same two commands in one transaction
//!   (<https://github.com/sidekiq/sidekiq/blob/main/lib/sidekiq/client.rb>, `raw_push`).
//!   Confirmed = the `EXEC` reply with the `LPUSH` count: the jobs are in Redis's memory
//!   (durable as the server's persistence settings make them; see the Redis Streams sink).
//! - Permanent: `WRONGTYPE` (`queue:NAME` holds something that is not a list), `NOPERM`, a
//!   job over `max_message_bytes` (default 512 MiB), a JSON `content-type` whose payload
//!   does not parse. Unavailable and transient as for the Redis Streams sink.
//! - Scheduling: the relay pushes a job when its message is due (`Message::delay`,
//!   `available_at`), so the `at` field and Sidekiq's `schedule` set are not used.
//!
//! Payloads never appear in logs; [`Sink::describe`] omits the credentials.

use super::redis_client::{RedisServer, RedisUrl, classify_reply, split_url};
use super::{Confirmations, PublishCode, PublishError, Sink, SinkError};
use crate::message::{OutgoingMessage, header};
use crate::redact::redact_url as redact;
use async_trait::async_trait;
use base64::Engine as _;
use redis::{RedisResult, Value};
use serde_json::{Map, Value as Json, json};
use std::time::Duration;

/// Redis's default `proto-max-bulk-len`, the largest single argument it accepts, in bytes
/// (512 MiB): the default bound on one job's JSON.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 512 * 1024 * 1024;

/// What a job's `retry` field says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// `true`: Sidekiq's default retries (25, with its own backoff), then its dead set.
    Default,
    /// `false`: no retry; a failing job goes to the dead set at once.
    Never,
    /// At most this many retries.
    Times(u32),
}

/// Settings of the Sidekiq sink; [`SidekiqSink::connect`] reads them from the URL.
#[derive(Debug, Clone)]
pub struct SidekiqOptions {
    /// The Sidekiq queue (`queue:NAME`), default `default`.
    pub queue: String,
    /// The worker class.
    pub class: String,
    /// The jobs' `retry` field.
    pub retry: Retry,
    /// Largest job JSON sent, in bytes (default [`DEFAULT_MAX_MESSAGE_BYTES`]); larger
    /// messages are permanent failures.
    pub max_message_bytes: usize,
    /// Bound on making the connection (default 5 s).
    pub connect_timeout: Duration,
    /// Bound on one batch's reply (default 8 s, below the relay's default publish timeout
    /// of 10 s); a timeout replaces the connection.
    pub response_timeout: Duration,
}

/// Pushes each message as a Sidekiq job onto one queue.
pub struct SidekiqSink {
    server: RedisServer,
    options: SidekiqOptions,
    describe: String,
}

impl std::fmt::Debug for SidekiqSink {
    /// The description only, as logs show it: no credentials (see [`Sink::describe`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SidekiqSink").field(&self.describe).finish()
    }
}

impl SidekiqSink {
    /// Reads `url` (see the module docs) and tries to connect. A server that cannot be
    /// reached is not an error here: it is logged, and each batch retries the connection.
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] when the URL cannot be parsed, lacks `class`, names a
    /// queue Redis would read as a pattern, carries an unknown parameter or names a TLS
    /// file that cannot be read; [`SinkError::Open`] when the TLS handshake fails or the
    /// server refuses the credentials at start.
    pub async fn connect(url: &str) -> Result<Self, SinkError> {
        let (parts, options) = parse_url(url)?;
        let server = RedisServer::open(
            url,
            &parts,
            options.connect_timeout,
            options.response_timeout,
            &redact(url),
        )
        .await?;
        let describe = format!(
            "sidekiq {} queue {} class {}",
            server.address, options.queue, options.class
        );
        Ok(SidekiqSink {
            server,
            options,
            describe,
        })
    }

    /// The job hash of `m`, as JSON text.
    fn job(&self, m: &OutgoingMessage, enqueued_at: f64) -> Result<String, PublishError> {
        let mut envelope = Map::new();
        envelope.insert("message_id".into(), json!(m.message_id.to_string()));
        envelope.insert("topic".into(), json!(m.topic));
        envelope.insert("key".into(), json!(m.key));
        envelope.insert(
            "occurred_at".into(),
            json!(
                m.occurred_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
            ),
        );
        let headers: Map<String, Json> = m
            .headers
            .iter()
            .filter(|(name, _)| !header::RESERVED.contains(&name.as_str()))
            .map(|(name, value)| (name.clone(), json!(value)))
            .collect();
        envelope.insert("headers".into(), Json::Object(headers));
        let payload = payload_value(m, &mut envelope)?;
        let retry = match self.options.retry {
            Retry::Default => json!(true),
            Retry::Never => json!(false),
            Retry::Times(n) => json!(n),
        };
        let created_at = m.occurred_at.timestamp_micros() as f64 / 1e6;
        Ok(json!({
            "class": self.options.class,
            "args": [payload, Json::Object(envelope)],
            "jid": m.message_id.simple().to_string(),
            "queue": self.options.queue,
            "retry": retry,
            "created_at": created_at,
            "enqueued_at": enqueued_at,
        })
        .to_string())
    }
}

/// The job's first argument (see the module docs).
fn payload_value(
    m: &OutgoingMessage,
    envelope: &mut Map<String, Json>,
) -> Result<Json, PublishError> {
    let content_type = m.headers.get(header::CONTENT_TYPE).map(|t| {
        t.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    });
    let says_json = content_type
        .as_deref()
        .map(|t| t == "application/json" || t.ends_with("+json"));
    // Parsed once, only when the content-type says JSON or says nothing.
    let parsed = (says_json != Some(false)).then(|| serde_json::from_slice::<Json>(&m.payload));
    match (says_json, parsed) {
        (Some(true), Some(parsed)) => parsed.map_err(|e| {
            PublishError::permanent(format!(
                "the payload's content-type says JSON but it does not parse: {e}"
            ))
            .with_code(PublishCode::Rejected)
        }),
        (None, Some(Ok(value))) => Ok(value),
        _ => Ok(match std::str::from_utf8(&m.payload) {
            Ok(text) => Json::String(text.to_owned()),
            Err(_) => {
                envelope.insert("payload_encoding".into(), json!("base64"));
                Json::String(base64::engine::general_purpose::STANDARD.encode(&m.payload))
            }
        }),
    }
}

#[async_trait]
impl Sink for SidekiqSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        if batch.is_empty() {
            return;
        }
        let now = chrono::Utc::now().timestamp_micros() as f64 / 1e6;
        let mut jobs = Vec::with_capacity(batch.len());
        let mut sent = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            match self.job(m, now) {
                Ok(job) if job.len() > self.options.max_message_bytes => {
                    confirm.set(
                        i,
                        Err(PublishError::permanent(format!(
                            "job of {} bytes exceeds the limit of {} bytes",
                            job.len(),
                            self.options.max_message_bytes
                        ))
                        .with_code(PublishCode::TooLarge)),
                    );
                }
                Ok(job) => {
                    jobs.push(job);
                    sent.push(i);
                }
                Err(e) => {
                    confirm.set(i, Err(e));
                }
            }
        }
        if sent.is_empty() {
            return;
        }
        let queue = &self.options.queue;
        let mut pipe = redis::pipe();
        pipe.atomic().ignore_errors();
        pipe.cmd("SADD").arg("queues").arg(queue);
        // LPUSH a b c leaves c at the left: the oldest job is at the right, BRPOP's end.
        pipe.cmd("LPUSH").arg(format!("queue:{queue}")).arg(&jobs);
        let mut conn = match self.server.connection().await {
            Ok(c) => c,
            Err(e) => {
                confirm.fail_unset(&e);
                return;
            }
        };
        let outcome: Result<(), PublishError> = match pipe
            .query_async::<Vec<RedisResult<Value>>>(&mut conn)
            .await
        {
            Ok(replies) => match replies.get(1) {
                Some(Ok(Value::Int(_))) => Ok(()),
                Some(Err(e)) => Err(classify_reply(
                    e,
                    &format!("LPUSH queue:{queue}"),
                    format!(
                        "Redis key \"queue:{queue}\" exists and is not a list (WRONGTYPE): it is not a Sidekiq queue"
                    ),
                )),
                other => Err(PublishError::transient(format!(
                    "unexpected reply to MULTI/SADD/LPUSH/EXEC: {other:?}"
                ))
                .with_code(PublishCode::Other)),
            },
            Err(e) => {
                // No usable reply: the jobs may or may not be queued (a retry can
                // duplicate them, with the same jid).
                self.server.reset().await;
                Err(PublishError::unavailable(format!(
                    "Redis transaction to {} failed: {e}",
                    self.server.address
                ))
                .with_code(PublishCode::NotConnected))
            }
        };
        for i in sent {
            confirm.set(i, outcome.clone());
        }
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// Reads the URL's parameters.
fn parse_url(url: &str) -> Result<(RedisUrl, SidekiqOptions), SinkError> {
    let invalid = |reason: String| SinkError::InvalidUrl {
        url: redact(url),
        reason,
    };
    let parts = split_url(url, "sidekiq", "sidekiqs")?;
    let mut options = SidekiqOptions {
        queue: "default".into(),
        class: String::new(),
        retry: Retry::Default,
        max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        connect_timeout: Duration::from_secs(5),
        response_timeout: Duration::from_secs(8),
    };
    for (k, v) in &parts.params {
        match k.as_str() {
            "queue" => options.queue.clone_from(v),
            "class" => options.class.clone_from(v),
            "retry" => {
                options.retry = match v.as_str() {
                    "true" => Retry::Default,
                    "false" => Retry::Never,
                    n => Retry::Times(n.parse().map_err(|_| {
                        invalid(format!("retry {n:?}: true, false or a number of retries"))
                    })?),
                }
            }
            "max_message_bytes" => {
                options.max_message_bytes =
                    v.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| {
                        invalid(format!("max_message_bytes {v:?} is not a positive integer"))
                    })?;
            }
            k => {
                return Err(invalid(format!(
                    "unknown parameter {k:?} (known: class, queue, retry, max_message_bytes, protocol)"
                )));
            }
        }
    }
    if options.class.is_empty() {
        return Err(invalid(
            "class is required: the worker class Sidekiq runs, e.g. ?class=WelcomeEmailJob".into(),
        ));
    }
    if options.class.chars().any(char::is_control) {
        return Err(invalid("class contains a control character".into()));
    }
    if options.queue.is_empty()
        || options.queue.contains(['*', '?', '[', ']', '\\'])
        || options.queue.chars().any(char::is_control)
    {
        return Err(invalid(format!(
            "queue {:?}: a Sidekiq queue name is not empty and has no glob (* ? [ ] \\) or control character",
            options.queue
        )));
    }
    Ok((parts, options))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn message(payload: &[u8], content_type: Option<&str>) -> OutgoingMessage {
        let mut headers = BTreeMap::new();
        if let Some(t) = content_type {
            headers.insert(header::CONTENT_TYPE.to_owned(), t.to_owned());
        }
        headers.insert("correlation-id".to_owned(), "req 7".to_owned());
        OutgoingMessage {
            id: 1,
            message_id: uuid::Uuid::from_u128(0x0193_aabb_ccdd_7eef_8011_2233_4455_6677),
            topic: "emails.welcome".into(),
            key: Some("user-42".into()),
            payload: bytes::Bytes::copy_from_slice(payload),
            headers,
            occurred_at: chrono::DateTime::from_timestamp_micros(1_765_000_000_250_000).unwrap(),
            attempts: 1,
        }
    }

    fn sink() -> SidekiqSink {
        let (_, options) =
            parse_url("sidekiq://127.0.0.1:1?class=WelcomeJob&queue=mailers").unwrap();
        SidekiqSink {
            server: offline_server(),
            options,
            describe: String::new(),
        }
    }

    /// A server that is never contacted (the job is built without Redis).
    fn offline_server() -> RedisServer {
        RedisServer::unconnected("redis://127.0.0.1:1").unwrap()
    }

    #[test]
    fn the_job_is_sidekiqs_hash_with_the_payload_and_the_envelope() {
        let job: Json = serde_json::from_str(
            &sink()
                .job(&message(br#"{"user":42}"#, Some("application/json")), 1.5)
                .unwrap(),
        )
        .unwrap();
        assert_eq!(job["class"], "WelcomeJob");
        assert_eq!(job["queue"], "mailers");
        assert_eq!(job["retry"], true);
        assert_eq!(job["jid"], "0193aabbccdd7eef8011223344556677");
        assert_eq!(job["created_at"], 1_765_000_000.25);
        assert_eq!(job["enqueued_at"], 1.5);
        assert_eq!(job["args"][0], json!({"user": 42}));
        let envelope = &job["args"][1];
        assert_eq!(
            envelope["message_id"],
            "0193aabb-ccdd-7eef-8011-223344556677"
        );
        assert_eq!(envelope["topic"], "emails.welcome");
        assert_eq!(envelope["key"], "user-42");
        assert_eq!(envelope["occurred_at"], "2025-12-06T05:46:40.250000Z");
        assert_eq!(envelope["headers"]["correlation-id"], "req 7");
    }

    #[test]
    fn payloads_that_are_not_json_are_strings_or_base64() {
        let s = sink();
        let arg0 = |payload: &[u8], ct| {
            let job: Json =
                serde_json::from_str(&s.job(&message(payload, ct), 0.0).unwrap()).unwrap();
            (
                job["args"][0].clone(),
                job["args"][1]["payload_encoding"].clone(),
            )
        };
        assert_eq!(arg0(b"42", None), (json!(42), Json::Null));
        assert_eq!(arg0(b"42", Some("text/plain")), (json!("42"), Json::Null));
        assert_eq!(arg0(b"hello", None), (json!("hello"), Json::Null));
        assert_eq!(
            arg0(b"[1]", Some("application/cloudevents+json")),
            (json!([1]), Json::Null)
        );
        assert_eq!(arg0(&[0xff, 0x00], None), (json!("/wA="), json!("base64")));
        let refused = s.job(&message(b"not json", Some("application/json")), 0.0);
        assert_eq!(refused.unwrap_err().kind, crate::sink::ErrorKind::Permanent);
    }

    #[test]
    fn the_url_names_the_class_and_a_queue_redis_can_hold() {
        let (parts, o) = parse_url("sidekiq://:pw@h:6379/2?class=A::B&queue=q1&retry=3").unwrap();
        assert_eq!(parts.client_url, "redis://:pw@h:6379/2");
        assert_eq!(
            (o.class.as_str(), o.queue.as_str(), o.retry),
            ("A::B", "q1", Retry::Times(3))
        );
        let (_, o) = parse_url("sidekiq://h?class=C").unwrap();
        assert_eq!((o.queue.as_str(), o.retry), ("default", Retry::Default));
        assert!(parse_url("sidekiq://h").is_err(), "class is required");
        assert!(parse_url("sidekiq://h?class=C&queue=a*").is_err());
        assert!(parse_url("sidekiq://h?class=C&retry=maybe").is_err());
        assert!(parse_url("sidekiq://h?class=C&envelope=cloudevents").is_err());
        assert!(parse_url("redis://h?class=C").is_err());
    }
}
