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
//!   With `envelope=cloudevents` (and `ce_source=URI-reference`), CloudEvents structured
//!   mode instead (the NATS binding 1.0.2 defines no other): the payload is the JSON event
//!   ([`crate::cloudevents`]), with the header `Content-Type: application/cloudevents+json`;
//!   `Nats-Msg-Id` stays.
//! - Control subjects are refused: the subject on the wire is the topic unchanged (no
//!   prefix, no fixed subject), so a topic starting with `$` or `_INBOX.` fails
//!   permanently with the code [`CONTROL_TOPIC`](super::CONTROL_TOPIC), before anything
//!   is sent and whether or not the server is reachable. NATS reserves every subject
//!   starting with `$` for the system (<https://docs.nats.io/nats-concepts/subjects>,
//!   "Reserved subject names"): `$JS.API.>` is the JetStream API, which creates, updates,
//!   purges and deletes streams and consumers
//!   (<https://docs.nats.io/reference/reference-protocols/nats_api_reference>), `$JS.ACK.`
//!   and `$JS.FC.` acknowledge and pace consumers, `$KV.` and `$O.` are the key-value and
//!   object stores' streams, `$SYS.` the system account's requests and events
//!   (<https://docs.nats.io/running-a-nats-service/configuration/sys_accounts>), `$MQTT.`
//!   the MQTT gateway's sessions and retained messages, `$JSC.`, `$NRG.`, `$G` and the
//!   others the server's own. Published with the relay's credentials, such a topic would
//!   let any producer administer the server. `_INBOX.` is the clients' reply prefix
//!   (<https://docs.nats.io/nats-concepts/core-nats/reqreply>): a message there would
//!   answer another client's request, or pose as a PubAck this sink awaits.
//! - Errors (each rule and its source: the user guide's "Error classification per sink",
//!   `docs/guide/src/error-classification.md`, and
//!   the JetStream error code table in this module's source): a subject that no stream covers, a message over the
//!   server's `max_payload` or the stream's `max_msg_size` (10054), a header NATS cannot
//!   carry (CR/LF), a topic that is not a publishable subject, and the other refusals of
//!   one message (expectation, TTL, rollup, counter and schedule headers; a sealed stream)
//!   are permanent; no connection, an acknowledgement timeout, a broken pipe, a server
//!   without JetStream (no responders, 10076, 10039), a stream offline or out of resources
//!   (a full stream with `discard: new`) mean the destination is unavailable (the message
//!   keeps its attempts); anything else is transient.

use super::{Confirmations, ErrorKind, PublishCode, PublishError, Sink, SinkError};
use crate::cloudevents::{Binding, ENVELOPE_PARAM, EnvelopeFormat, JSON_FORMAT, SOURCE_PARAM};
use crate::message::OutgoingMessage;
use crate::redact::{redact_url, scrub};
use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_trait::async_trait;
use futures::future::join_all;
use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
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
    envelope: EnvelopeFormat,
}

impl std::fmt::Debug for NatsSink {
    /// The description only, as logs show it: no credentials (see [`Sink::describe`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("NatsSink").field(&self.describe()).finish()
    }
}

impl NatsSink {
    /// Connects to `url`: `nats://HOST:PORT` (TLS when the server requires it) or
    /// `tls://HOST:PORT` (TLS always), optionally with `USER:PASS@` or `TOKEN@`
    /// (percent-encoded) and these query parameters:
    /// - `ca=PATH`, `cert=PATH&key=PATH`, `password_file=PATH`: see [`super::tls`];
    /// - `token_file=PATH`: the token, read from a file;
    /// - `nkey=PATH`: a file holding an NKey seed (`SU…`), signing the server's nonce;
    /// - `creds=PATH`: a `.creds` file (user JWT and NKey seed), as `nsc` writes them;
    /// - `envelope=cloudevents` (or `cloudevents-structured`), `ce_source=URI-reference`:
    ///   CloudEvents structured mode ([`crate::cloudevents`]).
    ///
    /// The connection is made in the background and kept alive: a server that is down at
    /// start makes publishes report the destination unavailable until it is up (their
    /// attempts are given back); it does not fail the relay. What can never work fails
    /// here instead: a certificate the server refuses or that is not trusted (one TLS
    /// handshake at start, [`super::tls::check_handshake`]), and credentials the server
    /// refused while the first connection was being made.
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] when the URL cannot be parsed or a file it names cannot be
    /// read; [`SinkError::Open`] for a TLS handshake that failed or credentials the server
    /// refused.
    pub async fn connect(url: &str, options: NatsOptions) -> Result<Self, SinkError> {
        let invalid = |reason: String| SinkError::InvalidUrl {
            url: redact(url),
            reason,
        };
        let mut parsed = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
        let tls_always = match parsed.scheme() {
            "nats" => false,
            "tls" => true,
            other => {
                return Err(invalid(format!(
                    "the scheme must be nats:// or tls://, not {other}://"
                )));
            }
        };
        let files = super::tls::take_settings(&mut parsed).map_err(|e| invalid(e.to_string()))?;
        let mut token_file = None;
        let mut nkey = None;
        let mut creds = None;
        let mut envelope = None;
        let mut source = None;
        let mut rest = Vec::new();
        for (k, v) in parsed.query_pairs() {
            let path = std::path::PathBuf::from(v.as_ref());
            match k.as_ref() {
                "token_file" => token_file = Some(path),
                "nkey" => nkey = Some(path),
                "creds" => creds = Some(path),
                ENVELOPE_PARAM => envelope = Some(v.into_owned()),
                SOURCE_PARAM => source = Some(v.into_owned()),
                other => rest.push(other.to_owned()),
            }
        }
        if !rest.is_empty() {
            return Err(invalid(format!(
                "unknown query parameter(s) {rest:?}: the NATS sink takes ca, cert, key, password_file, token_file, nkey, creds, envelope and ce_source"
            )));
        }
        let envelope =
            EnvelopeFormat::parse(Binding::Nats, "", envelope.as_deref(), source.as_deref())
                .map_err(invalid)?;
        parsed.set_query(None);
        let mut connect = async_nats::ConnectOptions::new();
        // async-nats reads no credentials from the URL itself: pass them on.
        match url_credentials(parsed.as_str()) {
            Some((user, Some(pass))) => connect = connect.user_and_password(user, pass),
            Some((token, None)) => connect = connect.token(token),
            None => {}
        }
        if let Some(path) = &token_file {
            connect = connect.token(
                super::tls::read_secret("token_file", path).map_err(|e| invalid(e.to_string()))?,
            );
        }
        if let Some(path) = &nkey {
            let seed = super::tls::read_secret("nkey", path).map_err(|e| invalid(e.to_string()))?;
            if !seed.starts_with('S') {
                return Err(invalid(format!(
                    "nkey file {path:?} does not hold an NKey seed (a line starting with S)"
                )));
            }
            connect = connect.nkey(seed);
        }
        if let Some(path) = &creds {
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid(format!("cannot read creds file {path:?}: {e}")))?;
            connect = connect
                .credentials(&text)
                .map_err(|e| invalid(format!("creds file {path:?}: {e}")))?;
        }
        let tls_required = tls_always || files.cert.is_some();
        let tls = match files.client_config() {
            Ok(config) => config,
            // The default CA (OUTBOX_TLS_CA_FILE) matters only if TLS is used: a plain
            // nats:// URL keeps working when it cannot be read, and TLS, if the server
            // asks for it, trusts the system's roots.
            Err(e) if files.default_ca && !tls_required => {
                tracing::warn!(error = %e, "the default CA file is not used for {}", redact(url));
                super::tls::TlsFiles {
                    ca: None,
                    ..files.clone()
                }
                .client_config()
                .map_err(|e| invalid(e.to_string()))?
            }
            Err(e) => return Err(invalid(e.to_string())),
        };
        let tls = Arc::new(tls);
        let host = parsed.host_str().unwrap_or("127.0.0.1").to_owned();
        let port = parsed.port().unwrap_or(4222);
        super::tls::check_handshake(
            &host,
            port,
            tls.clone(),
            super::tls::Preamble::NatsInfo {
                required: tls_required,
            },
            files.ca.as_deref(),
        )
        .await
        .map_err(|e| SinkError::Open {
            url: redact(url),
            source: Box::new(e),
        })?;
        let refused: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
        let seen = refused.clone();
        // The server's address without credentials or parameters (they were taken above).
        let _ = parsed.set_password(None);
        let _ = parsed.set_username("");
        let client = connect
            .tls_client_config((*tls).clone())
            .require_tls(tls_required)
            .event_callback(move |event| {
                let seen = seen.clone();
                async move {
                    // While the first connection is made, a refusal comes as a client
                    // error naming the connect error's kind; later, as a server error.
                    let refusal = match &event {
                        async_nats::Event::ServerError(
                            async_nats::ServerError::AuthorizationViolation,
                        ) => Some("authorization violation".to_owned()),
                        async_nats::Event::ClientError(async_nats::ClientError::Other(text))
                            if text.contains("authoriz") || text.contains("signing nonce") =>
                        {
                            Some(text.clone())
                        }
                        _ => None,
                    };
                    if let Some(refusal) = refusal
                        && let Ok(mut slot) = seen.lock()
                    {
                        *slot = Some(format!("the server refused the credentials ({refusal})"));
                    }
                }
            })
            .retry_on_initial_connect()
            .max_reconnects(None)
            // Reconnect quickly after a broker restart: 50 ms doubling to at most 1 s.
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis(50u64.saturating_mul(1 << attempts.min(5)))
                    .min(Duration::from_secs(1))
            })
            .connection_timeout(Duration::from_secs(2))
            .connect(parsed.as_str())
            .await
            .map_err(|e| invalid(hide(&e.to_string(), url)))?;
        let js = async_nats::jetstream::ContextBuilder::new()
            .timeout(options.ack_timeout)
            .build(client.clone());
        let sink = NatsSink {
            client,
            js,
            describe: redact(url),
            envelope,
        };
        // Give the first connection a moment, so the first batch does not find it still
        // being made; a server that is down is not an error here, but it is said once.
        if !sink.connected_within(INITIAL_CONNECT_WAIT).await {
            let refusal = refused.lock().ok().and_then(|r| r.clone());
            if let Some(reason) = refusal {
                sink.client.drain().await.ok();
                return Err(SinkError::Open {
                    url: redact(url),
                    source: reason.into(),
                });
            }
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

    /// The headers (`Nats-Msg-Id` among them) and payload of `m` in this sink's envelope.
    fn encode(&self, m: &OutgoingMessage) -> Result<(HeaderMap, bytes::Bytes), PublishError> {
        match self.envelope.cloudevents() {
            None => Ok((Self::headers(m)?, m.payload.clone())),
            // Structured mode (the only one of binding 1.0.2); the header marks it for a
            // receiver of the 1.0.3 draft, which also knows a binary mode.
            Some(ce) => {
                let mut h = HeaderMap::new();
                h.insert("Content-Type", JSON_FORMAT);
                h.insert(
                    async_nats::header::NATS_MESSAGE_ID,
                    async_nats::HeaderValue::from(m.message_id.to_string()),
                );
                Ok((h, bytes::Bytes::from(ce.event(m)?.to_json())))
            }
        }
    }

    /// The envelope as NATS headers ([`OutgoingMessage::envelope_headers`]: message id,
    /// topic, key, occurred-at, then the stored headers), plus JetStream's `Nats-Msg-Id`
    /// (the message id: the stream drops a copy within its duplicate window). Built straight
    /// into the map, per message: the envelope's names are static (nothing parsed or
    /// allocated) and the message id and the time are moved in (neither can hold CR or LF);
    /// the topic, the key and the stored headers are checked, since NATS cannot carry CR or
    /// LF in a value. It writes the envelope's fields again rather than iterate
    /// `envelope_headers`, for cost: under callgrind (the CLI relay to JetStream), parsing
    /// each pair's name and copying its value cost about 1,450 instructions per message,
    /// and iterating the pairs with static names and moved values still about 1,300 (of
    /// some 33,500). The sink conformance cases read the envelope back from the headers,
    /// so the two cannot drift apart unseen.
    fn headers(m: &OutgoingMessage) -> Result<HeaderMap, PublishError> {
        use crate::message::header;
        use async_nats::{HeaderName, HeaderValue};
        const MESSAGE_ID: HeaderName = HeaderName::from_static(header::MESSAGE_ID);
        const TOPIC: HeaderName = HeaderName::from_static(header::TOPIC);
        const KEY: HeaderName = HeaderName::from_static(header::KEY);
        const OCCURRED_AT: HeaderName = HeaderName::from_static(header::OCCURRED_AT);
        let value = |name: &str, value: &str| {
            HeaderValue::from_str(value).map_err(|_| {
                PublishError::permanent(format!(
                    "header {name:?} has a value NATS cannot carry (CR or LF)"
                ))
                .with_code(PublishCode::InvalidHeader)
            })
        };
        let id = m.message_id.to_string();
        let mut h = HeaderMap::new();
        h.insert(
            async_nats::header::NATS_MESSAGE_ID,
            HeaderValue::from(id.clone()),
        );
        h.insert(MESSAGE_ID, HeaderValue::from(id));
        h.insert(TOPIC, value(header::TOPIC, &m.topic)?);
        if let Some(k) = &m.key {
            h.insert(KEY, value(header::KEY, k)?);
        }
        h.insert(
            OCCURRED_AT,
            HeaderValue::from(
                m.occurred_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            ),
        );
        // Stored headers never override the envelope (as `envelope_headers`).
        for (name, v) in &m.headers {
            if header::RESERVED.contains(&name.as_str()) {
                continue;
            }
            let n = HeaderName::from_str(name).map_err(|_| {
                PublishError::permanent(format!("header name {name:?} is not valid in NATS"))
                    .with_code(PublishCode::InvalidHeader)
            })?;
            h.insert(n, value(name, v)?);
        }
        Ok(h)
    }

    /// Is every topic `pattern` matches covered by a JetStream stream (a stream's subject
    /// that is equal to or wider than it: `orders.>` covers `orders.*.v1`)? With
    /// `create`, a missing one is created: named by [`stream_name_for`], subjects
    /// `[pattern]`, file storage, limits retention, one replica, discard old, the
    /// server's default duplicate window (2 min, wider than a lease, so a message sent
    /// again after a relay crash within it is dropped by `Nats-Msg-Id`). A stream that
    /// covers only part of the pattern is named in [`StreamCheck::Missing`] and never
    /// changed. Source:
    /// <https://docs.nats.io/nats-concepts/jetstream/streams#configuration>.
    ///
    /// # Errors
    /// The JetStream API's error, as text, when the server cannot be asked (down, no
    /// JetStream, no permission) or refuses the new stream (e.g. its subjects overlap
    /// another stream's).
    pub async fn ensure_stream(
        &self,
        pattern: &crate::topic::TopicPattern,
        create: bool,
    ) -> Result<StreamCheck, String> {
        use futures::TryStreamExt as _;
        let mut streams = self.js.streams();
        let mut partial = None;
        while let Some(info) = streams
            .try_next()
            .await
            .map_err(|e| format!("listing JetStream streams on {}: {e}", self.describe))?
        {
            let subjects = &info.config.subjects;
            if subjects.iter().any(|s| subject_covers(s, pattern.as_str())) {
                return Ok(StreamCheck::Covered {
                    stream: info.config.name,
                });
            }
            if partial.is_none()
                && subjects
                    .iter()
                    .any(|s| subjects_overlap(s, pattern.as_str()))
            {
                partial = Some(info.config.name);
            }
        }
        let name = stream_name_for(pattern.as_str());
        if !create || partial.is_some() {
            return Ok(StreamCheck::Missing {
                suggested: name,
                partial,
            });
        }
        self.js
            .create_stream(async_nats::jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![pattern.as_str().to_owned()],
                storage: async_nats::jetstream::stream::StorageType::File,
                retention: async_nats::jetstream::stream::RetentionPolicy::Limits,
                discard: async_nats::jetstream::stream::DiscardPolicy::Old,
                num_replicas: 1,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating JetStream stream {name} on {}: {e}", self.describe))?;
        Ok(StreamCheck::Created { stream: name })
    }

    /// A publish got "no responders" (status 503): is `subject` really covered by no
    /// stream? Asks the JetStream API (`$JS.API.STREAM.NAMES` filtered by subject):
    /// - it answers with no stream → permanent (the message's subject is the problem);
    /// - it has no responders itself, or answers 10076 "JetStream not enabled" / 10039
    ///   "JetStream not enabled for account" → unavailable: the server has no JetStream, so
    ///   the destination is missing, not the message (a server still starting up answers
    ///   the same way);
    /// - it names a stream (which did not answer the publish) → unavailable;
    /// - anything else → transient.
    ///
    /// Sources: <https://docs.nats.io/reference/reference-protocols/nats_api_reference>
    /// (no responders, status 503) and the server's error list
    /// (<https://github.com/nats-io/nats-server/blob/main/server/errors.json>).
    async fn confirm_no_stream(&self, subject: &str) -> PublishError {
        use async_nats::jetstream::context::GetStreamByNameErrorKind as K;
        match self.js.stream_by_subject(subject).await {
            Err(e) if matches!(e.kind(), K::NotFound) => PublishError::permanent(format!(
                "no JetStream stream covers subject {subject:?}: create a stream whose subjects include it"
            ))
            .with_code(PublishCode::NoDestination),
            Err(e) if matches!(e.kind(), K::InvalidSubject) => {
                PublishError::permanent(format!("{subject:?} is not a valid NATS subject"))
                    .with_code(PublishCode::InvalidTopic)
            }
            Ok(stream) => PublishError::unavailable(format!(
                "JetStream stream {stream:?} (covering {subject:?}) did not answer the publish"
            ))
            .with_code(PublishCode::DestinationDown),
            Err(e) => match api_failure(&e) {
                ApiFailure::NotEnabled(why) => PublishError::unavailable(format!(
                    "JetStream is not available on {}: {why} (enable JetStream on the server, or for the account)",
                    self.describe
                ))
                .with_code(PublishCode::DestinationDown),
                // The JetStream API did not answer within the ack timeout: judged by the
                // router like any timeout.
                ApiFailure::TimedOut => {
                    PublishError::timed_out(format!("JetStream API did not answer in time: {e}"))
                }
                ApiFailure::Other => PublishError::transient(format!("JetStream API: {e}")),
            },
        }
    }
}

#[async_trait]
impl Sink for NatsSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        // Control subjects are refused first: permanent even while the server is down.
        for (i, m) in batch.iter().enumerate() {
            if let Some(e) = control_subject_error(&m.topic) {
                confirm.set(i, Err(e));
            }
        }
        if !self.connected_within(Duration::from_millis(500)).await {
            let e = PublishError::unavailable(format!("not connected to {}", self.describe))
                .with_code(PublishCode::NotConnected);
            confirm.fail_unset(&e);
            return;
        }
        // Send every publish first (pipelined), then collect the PubAcks.
        let mut pending = Vec::with_capacity(batch.len());
        for m in batch {
            if let Some(e) = control_subject_error(&m.topic) {
                pending.push(Err(Err_::Classified(e)));
                continue;
            }
            if !is_publishable_subject(&m.topic) {
                pending.push(Err(Err_::Classified(
                    PublishError::permanent(format!(
                        "topic {:?} is not a valid NATS subject: dot-separated non-empty tokens, no whitespace, no wildcards",
                        m.topic
                    ))
                    .with_code(PublishCode::InvalidTopic),
                )));
                continue;
            }
            let sent = match self.encode(m) {
                Err(e) => Err(Err_::Classified(e)),
                Ok((headers, payload)) => {
                    let msg = PublishMessage::build().payload(payload).headers(headers);
                    self.js
                        .send_publish(m.topic.clone(), msg)
                        .await
                        .map_err(|e| classify(e.kind(), e.to_string(), &m.topic))
                }
            };
            pending.push(sent);
        }
        // Each PubAck is recorded as it arrives; "no stream" needs an API call first.
        let acks = join_all(pending.into_iter().zip(batch).enumerate().map(
            |(i, (sent, m))| async move {
                let r = match sent {
                    Err(e) => Err(e),
                    Ok(ack) => ack
                        .await
                        .map(|_| ())
                        .map_err(|e| classify(e.kind(), e.to_string(), &m.topic)),
                };
                match r {
                    Ok(()) => {
                        confirm.set(i, Ok(()));
                        None
                    }
                    Err(Err_::Classified(e)) => {
                        confirm.set(i, Err(e));
                        None
                    }
                    Err(Err_::NoStream) => Some(i),
                }
            },
        ))
        .await;
        let mut no_stream: HashMap<&str, PublishError> = HashMap::new();
        for i in acks.into_iter().flatten() {
            let m = &batch[i];
            if !no_stream.contains_key(m.topic.as_str()) {
                let e = self.confirm_no_stream(&m.topic).await;
                no_stream.insert(m.topic.as_str(), e);
            }
            confirm.set(i, Err(no_stream[m.topic.as_str()].clone()));
        }
    }

    async fn close(&self) {
        // Every publish was already acknowledged or abandoned; a flush only matters while
        // connected, and must not wait for a server that is down.
        if self.client.connection_state() == async_nats::connection::State::Connected {
            let _ = tokio::time::timeout(Duration::from_secs(2), self.client.flush()).await;
        }
    }

    fn describe(&self) -> String {
        // The URL's query (with any `envelope`) is part of it already.
        self.describe.clone()
    }
}

/// The percent-decoded user name (or token) and password of `url`'s userinfo.
fn url_credentials(url: &str) -> Option<(String, Option<String>)> {
    let u = url::Url::parse(url).ok()?;
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    match (u.username(), u.password()) {
        ("", None) => None,
        (user, pass) => Some((decode(user), pass.map(decode))),
    }
}

/// `url` as logs, errors and [`Sink::describe`] show it: [`redact_url`], and a user name
/// without a password (`nats://TOKEN@host`) is a token, hidden as well (unless the password
/// comes from `password_file=`).
fn redact(url: &str) -> String {
    let redacted = redact_url(url);
    match url::Url::parse(&redacted) {
        Ok(mut u)
            if !u.username().is_empty()
                && u.password().is_none()
                && !u.query_pairs().any(|(k, _)| k == "password_file") =>
        {
            let _ = u.set_username(crate::redact::MASK);
            u.to_string()
        }
        _ => redacted,
    }
}

/// `text` (a client library's message) with `url`, its password and its token hidden.
fn hide(text: &str, url: &str) -> String {
    let mut out = scrub(text, url);
    if let Some((token, None)) = url_credentials(url)
        && token.chars().count() >= 3
    {
        out = out.replace(&token, crate::redact::MASK);
    }
    out
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

/// Why `subject` addresses the server rather than a stream, if it does: every subject
/// starting with `$` (reserved for the system: the JetStream API `$JS.API.`, `$KV.`, `$O.`,
/// `$SYS.`, `$MQTT.`, …) and the reply subjects under `_INBOX.` (see the module docs for
/// the sources). NATS subjects are case-sensitive, so `$js.api.x` is not the JetStream
/// API; it is refused anyway, as every `$` subject is.
fn control_subject(subject: &str) -> Option<&'static str> {
    if subject.starts_with('$') {
        Some(
            "NATS reserves subjects starting with $ for the server ($JS. JetStream API, $KV. key-value, $O. object store, $SYS. system, $MQTT. MQTT gateway, …); publishing there with the relay's credentials could create or delete streams",
        )
    } else if subject.starts_with("_INBOX.") || subject == "_INBOX" {
        Some(
            "_INBOX. subjects carry the replies to NATS requests; a message there would answer another client's request",
        )
    } else {
        None
    }
}

/// The permanent [`CONTROL_TOPIC`](super::CONTROL_TOPIC) error of a control subject.
fn control_subject_error(subject: &str) -> Option<PublishError> {
    control_subject(subject).map(|why| PublishError::control_topic(subject, why))
}

/// A publish error, or "no stream answered", which needs a JetStream API call to tell a
/// missing stream (permanent) from a server still starting (transient).
enum Err_ {
    Classified(PublishError),
    NoStream,
}

/// What a failed JetStream API request (not a publish) says about the server.
enum ApiFailure {
    /// No responders, or JetStream not enabled (10076) / not enabled for the account
    /// (10039): the text says which.
    NotEnabled(String),
    /// No answer in time.
    TimedOut,
    Other,
}

fn api_failure(e: &(dyn std::error::Error + 'static)) -> ApiFailure {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::{RequestError, RequestErrorKind};
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<RequestError>() {
            match r.kind() {
                RequestErrorKind::NoResponders => {
                    return ApiFailure::NotEnabled("no responders for the JetStream API".into());
                }
                RequestErrorKind::TimedOut => return ApiFailure::TimedOut,
                _ => {}
            }
        }
        if let Some(js) = err.downcast_ref::<async_nats::jetstream::Error>()
            && matches!(
                js.error_code(),
                ErrorCode::JETSTREAM_NOT_ENABLED | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT
            )
        {
            return ApiFailure::NotEnabled(js.to_string());
        }
        cur = err.source();
    }
    ApiFailure::Other
}

/// The JetStream error code of a publish error's text: async-nats renders the server's
/// API error as "… (code 400, error code 10054)".
fn jetstream_error_code(text: &str) -> Option<u64> {
    let rest = text.rsplit_once("error code ")?.1;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// What a JetStream error code in a PubAck means for the message, per the server's error
/// list (<https://github.com/nats-io/nats-server/blob/main/server/errors.json>) and the
/// stream documentation (<https://docs.nats.io/nats-concepts/jetstream/streams>,
/// <https://docs.nats.io/nats-concepts/jetstream/headers>). `None`: not a code this sink
/// knows (transient).
fn jetstream_code_kind(code: u64) -> Option<ErrorKind> {
    match code {
        // The message itself, or headers it carries, or a stream that can never take it:
        // 10054 message size exceeds the stream's max_msg_size; 10097 headers over 64 KiB;
        // 10060 `Nats-Expected-Stream` does not match; 10070 / 10071 / 10193
        // `Nats-Expected-Last-Msg-Id` / `-Last-Sequence` / `-Last-Subject-Sequence` do not
        // hold (optimistic concurrency: the same message can never pass); 10109 the stream
        // is sealed (sealing cannot be undone); 10111 `Nats-Rollup` refused; 10165 / 10166
        // `Nats-TTL` invalid or not allowed by the stream; 10168-10172 `Nats-Incr` counters;
        // 10177 / 10179 / 10200 / 10206 / 10207 atomic and batch publish headers; 10188-10192,
        // 10203, 10212, 10223 `Nats-Schedule*` headers.
        10054
        | 10097
        | 10060
        | 10070
        | 10071
        | 10193
        | 10109
        | 10111
        | 10165
        | 10166
        | 10168..=10172
        | 10177
        | 10179
        | 10200
        | 10206
        | 10207
        | 10188..=10192
        | 10203
        | 10212
        | 10223 => Some(ErrorKind::Permanent),
        // The destination, not the message: 10076 / 10039 JetStream not enabled (for the
        // account); 10008 "JetStream system temporarily unavailable"; 10009 the cluster
        // cannot handle the request (no leader); 10118 / 10194 stream offline; resources
        // and quotas: 10002 account resources exceeded, 10023 insufficient resources, 10028
        // memory and 10047 storage resources exceeded, 10077 store failed (a full stream
        // with `discard: new`: "maximum messages/bytes exceeded").
        10076 | 10039 | 10008 | 10009 | 10118 | 10194 | 10002 | 10023 | 10028 | 10047 | 10077 => {
            Some(ErrorKind::Unavailable)
        }
        _ => None,
    }
}

fn classify(kind: PublishErrorKind, text: String, topic: &str) -> Err_ {
    match kind {
        PublishErrorKind::MaxPayloadExceeded => Err_::Classified(
            PublishError::permanent(format!(
                "message on {topic:?} exceeds the NATS server's max_payload: {text}"
            ))
            .with_code(PublishCode::TooLarge),
        ),
        PublishErrorKind::StreamNotFound => Err_::NoStream,
        // No PubAck within the ack timeout: the router judges whether the message or the
        // destination is at fault.
        PublishErrorKind::TimedOut => {
            Err_::Classified(PublishError::timed_out(format!("NATS publish: {text}")))
        }
        // The connection went away before the PubAck.
        PublishErrorKind::BrokenPipe => Err_::Classified(
            PublishError::unavailable(format!("NATS publish: {text}"))
                .with_code(PublishCode::NotConnected),
        ),
        // Expectation headers the message carries (10070, 10071): it can never pass.
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            Err_::Classified(
                PublishError::permanent(format!(
                    "JetStream refused the message on {topic:?}: {text}"
                ))
                .with_code(PublishCode::Rejected),
            )
        }
        _ => Err_::Classified(
            match jetstream_error_code(&text).and_then(jetstream_code_kind) {
                Some(ErrorKind::Permanent) => PublishError::permanent(format!(
                    "JetStream refused the message on {topic:?}: {text}"
                ))
                .with_code(if jetstream_error_code(&text) == Some(10054) {
                    PublishCode::TooLarge
                } else {
                    PublishCode::Rejected
                }),
                Some(ErrorKind::Unavailable) => PublishError::unavailable(format!(
                    "JetStream cannot take messages on {topic:?} now: {text}"
                ))
                .with_code(PublishCode::DestinationDown),
                // Too many acks pending, codes this sink does not know, and anything
                // unexpected are transient.
                _ => PublishError::transient(format!("NATS publish: {text}")),
            },
        ),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_from_the_url() {
        assert_eq!(
            url_credentials("nats://relay:p%40ss@127.0.0.1:4222"),
            Some(("relay".into(), Some("p@ss".into())))
        );
        assert_eq!(
            url_credentials("nats://s3cr3t@127.0.0.1:4222"),
            Some(("s3cr3t".into(), None))
        );
        assert_eq!(url_credentials("nats://127.0.0.1:4222"), None);
    }

    #[tokio::test]
    async fn a_token_in_the_url_never_shows() {
        const TOKEN: &str = "s3cr3t-T0ken";
        // Nothing listens there: the sink opens and waits for the server.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("{e}"));
        let sink = NatsSink::connect(
            &format!("nats://{TOKEN}@127.0.0.1:{port}"),
            NatsOptions::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(!sink.describe().contains(TOKEN), "{}", sink.describe());
        assert!(sink.describe().contains("127.0.0.1"), "{}", sink.describe());
        let e = NatsSink::connect(
            &format!("nats://{TOKEN}@127.0.0.1:{port}?bogus=1"),
            NatsOptions::default(),
        )
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(e.contains("bogus") && !e.contains(TOKEN), "{e}");
        // A user with a password is a user name: it stays, the password goes.
        assert_eq!(redact("nats://relay:pw@h:4222"), "nats://relay:***@h:4222");
        assert_eq!(redact("nats://h:4222"), "nats://h:4222");
        assert_eq!(
            redact("nats://relay@h:4222?password_file=/run/pw"),
            "nats://relay@h:4222?password_file=***"
        );
    }

    #[test]
    fn control_subjects_are_recognised() {
        for s in [
            "$JS.API.STREAM.DELETE.ORDERS",
            "$JS.API.STREAM.CREATE.X",
            "$JS.ACK.S.C.1.1.1.1.0",
            "$KV.b.k",
            "$O.b.c",
            "$SYS.REQ.SERVER.PING",
            "$MQTT.sess.x",
            "$G",
            "$",
            "_INBOX.abc.def",
            "_INBOX",
        ] {
            let e = control_subject_error(s).unwrap();
            assert_eq!(
                (e.kind, e.code),
                (ErrorKind::Permanent, PublishCode::ControlTopic),
                "{s}"
            );
            assert!(
                e.message.contains(s) && e.message.contains("control topic"),
                "{e}"
            );
        }
        for s in [
            "orders.placed",
            "a$b",
            "JS.API.STREAM.DELETE.X",
            "_INBOXES.x",
            "inbox",
        ] {
            assert!(control_subject(s).is_none(), "{s}");
        }
    }

    #[test]
    fn jetstream_error_codes_are_read_and_classified() {
        let text =
            "publish failed: message size exceeds maximum allowed (code 400, error code 10054)";
        assert_eq!(jetstream_error_code(text), Some(10054));
        assert_eq!(jetstream_error_code("publish failed"), None);
        assert_eq!(jetstream_code_kind(10054), Some(ErrorKind::Permanent));
        assert_eq!(jetstream_code_kind(10109), Some(ErrorKind::Permanent));
        assert_eq!(jetstream_code_kind(10076), Some(ErrorKind::Unavailable));
        assert_eq!(jetstream_code_kind(10039), Some(ErrorKind::Unavailable));
        assert_eq!(jetstream_code_kind(10077), Some(ErrorKind::Unavailable));
        assert_eq!(jetstream_code_kind(10163), None);
        let Err_::Classified(e) = classify(PublishErrorKind::Other, text.into(), "t") else {
            panic!("classified");
        };
        assert_eq!(e.kind, ErrorKind::Permanent);
        let Err_::Classified(e) = classify(
            PublishErrorKind::MaxAckPending,
            "max ack pending reached".into(),
            "t",
        ) else {
            panic!("classified");
        };
        assert_eq!(e.kind, ErrorKind::Transient);
    }
}

/// What [`NatsSink::ensure_stream`] found or did for a topic pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamCheck {
    /// The stream `stream` covers every topic of the pattern.
    Covered {
        /// Its name.
        stream: String,
    },
    /// No stream covered the pattern; `stream` was created for it.
    Created {
        /// Its name.
        stream: String,
    },
    /// No stream covers every topic of the pattern: `suggested` is the name a created one
    /// would get; `partial`, a stream that covers some of its topics (which blocks
    /// creating one whose subjects would overlap it).
    Missing {
        /// The name [`stream_name_for`] gives.
        suggested: String,
        /// A stream that covers part of the pattern.
        partial: Option<String>,
    },
}

/// The stream name made for a topic pattern: its tokens before the first wildcard, upper
/// case, joined by `_`, each character that is not an ASCII letter, digit, `-` or `_`
/// replaced by `_` (stream names may not hold `.`, `*`, `>`, spaces or path
/// separators); `OUTBOX` for a pattern that starts with a wildcard. `orders.>` →
/// `ORDERS`, `eu.billing.*.v1` → `EU_BILLING`.
pub fn stream_name_for(pattern: &str) -> String {
    let head: Vec<String> = pattern
        .split('.')
        .take_while(|t| *t != "*" && *t != ">")
        .map(|t| {
            t.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                        c.to_ascii_uppercase()
                    } else {
                        '_'
                    }
                })
                .collect()
        })
        .collect();
    if head.is_empty() {
        "OUTBOX".to_owned()
    } else {
        head.join("_")
    }
}

/// Does the NATS subject filter `wide` match every subject `narrow` matches? Token by
/// token: `>` in `wide` takes the rest; `*` in `wide` takes one token (a literal or `*`
/// in `narrow`); a literal must be equal. `narrow`'s `>` is covered only by `>`.
pub fn subject_covers(wide: &str, narrow: &str) -> bool {
    let w: Vec<&str> = wide.split('.').collect();
    let n: Vec<&str> = narrow.split('.').collect();
    for (i, wt) in w.iter().enumerate() {
        if *wt == ">" {
            return n.len() > i;
        }
        let Some(nt) = n.get(i) else {
            return false;
        };
        if *nt == ">" {
            return false;
        }
        if *wt != "*" && wt != nt {
            return false;
        }
    }
    w.len() == n.len()
}

/// Could some subject match both filters `a` and `b`?
fn subjects_overlap(a: &str, b: &str) -> bool {
    let a: Vec<&str> = a.split('.').collect();
    let b: Vec<&str> = b.split('.').collect();
    for i in 0.. {
        match (a.get(i), b.get(i)) {
            (Some(&">"), Some(_)) | (Some(_), Some(&">")) => return true,
            (None, None) => return true,
            (Some(x), Some(y)) if *x == "*" || *y == "*" || x == y => {}
            _ => return false,
        }
    }
    false
}
