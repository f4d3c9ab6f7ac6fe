//! HTTP webhook sink (reqwest): one `POST` per message to a fixed endpoint.
//!
//! - URL = the endpoint (`http://` or `https://`, query string kept; userinfo is sent as
//!   HTTP Basic credentials). `describe()`, metrics labels and error messages show only its
//!   scheme, user name, host and port, with a short hash for the path and query, which may
//!   hold the endpoint's secret (`https://hooks.slack.com/…#3f2a9c1b`,
//!   [`crate::redact::redact_url`]). Redirects are not followed: a `POST` must not silently become a `GET` elsewhere
//!   (configure the final URL).
//! - The topic never reaches the URL: every message goes to the one configured endpoint,
//!   whatever its topic (`../admin`, `?x=`, `@host`, `#` in a topic change nothing), and
//!   the topic travels only in the `topic` header, percent-encoded like every envelope
//!   value (so CR/LF cannot split the request). Routing topics to different endpoints is
//!   the router's job, with one fixed URL per route.
//! - Body = the payload bytes, unchanged (empty payloads send an empty body).
//!   `Content-Type` = the message's `content-type` header, else `application/octet-stream`.
//! - Envelope = request headers named exactly as in [`OutgoingMessage::envelope_headers`]
//!   (`message-id`, `topic`, `key`, `occurred-at`, then the stored headers, e.g.
//!   `correlation-id`, `traceparent`), plus `Idempotency-Key` = message id
//!   (<https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/>), so a
//!   receiver can deduplicate a redelivery.
//! - **Header values are percent-encoded** where HTTP cannot carry them as they are: `%`,
//!   control characters, DEL, every non-ASCII byte of the UTF-8 text, and a leading or
//!   trailing space become `%XX` (upper-case hex); everything else is sent unchanged. HTTP
//!   field values are ASCII in practice (RFC 9110 §5.5 leaves other bytes "opaque", and
//!   proxies and frameworks decode them as Latin-1 or reject them) and lose leading/trailing
//!   whitespace. A receiver applies any standard percent-decoder (`decodeURIComponent`,
//!   `urllib.parse.unquote`, `percent_encoding::percent_decode_str`) to every envelope value
//!   and gets the exact stored text back; ids, topics, timestamps and trace context never
//!   contain these characters, so they arrive unchanged. `Content-Type` is not encoded: it
//!   must be a valid header value or the message is refused (permanent).
//! - Header names HTTP, a client, a proxy or this sink owns
//!   ([`crate::webhook::TRANSPORT_HEADERS`]: `host`, `content-length`, `transfer-encoding`,
//!   `connection`, `keep-alive`, `upgrade`, `te`, `trailer`, `expect`, `proxy-connection`,
//!   `idempotency-key`, `webhook-id`, `webhook-timestamp`, `webhook-signature`, `accept`,
//!   `accept-encoding`, `user-agent`, `authorization`, `via`, `forwarded`,
//!   `x-forwarded-for`, `x-forwarded-host`, `x-forwarded-proto`, `x-real-ip`) cannot come
//!   from a message, nor two names that differ only in case: such a message fails
//!   permanently rather than corrupt the request's framing, forge its signature or
//!   arrive as something else.
//! - Signing (optional): the Standard Webhooks scheme
//!   (<https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md>):
//!   `webhook-id` = message id, `webhook-timestamp` = Unix seconds at the attempt (this
//!   host's clock: receivers reject timestamps outside their tolerance, typically 5 min),
//!   `webhook-signature` = `v1,` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")). The
//!   secret comes from the environment only, never from the URL: [`SECRET_ENV`] or a file
//!   named by [`SECRET_FILE_ENV`], in the form `whsec_<base64>` (the key is the decoded
//!   bytes). It is never logged or shown by `describe()`.
//!
//! - CloudEvents (`outbox_envelope=cloudevents`, `outbox_ce_source=URI-reference`;
//!   [`crate::cloudevents`]): the HTTP binding's binary mode instead of the envelope
//!   headers: `ce-specversion`, `ce-id`, `ce-source`, `ce-type`, `ce-time` and the other
//!   attributes as `ce-` headers, values percent-encoded as the binding requires (space,
//!   `"`, `%` and everything outside printable ASCII), `Content-Type` = `datacontenttype`
//!   (no `Content-Type` without one), body = the payload.
//!   `outbox_envelope=cloudevents-structured`: `Content-Type: application/cloudevents+json`
//!   and the JSON event as the body. `Idempotency-Key` and the signature headers stay
//!   (the signature covers the body sent); no `message-id`, `topic`, `key` or
//!   `occurred-at` headers.
//!
//! Confirmed = a `2xx` response. Classification (RFC 9110 §15; the user guide's "Error
//! classification per sink", `docs/guide/src/error-classification.md`):
//! - `429` Too Many Requests (RFC 6585 §4) and `503` Service Unavailable (RFC 9110
//!   §15.6.4) → unavailable: the endpoint is rate limiting or overloaded, which says
//!   nothing about the message (the relay gives the attempt back and the destination backs
//!   off), with [`PublishError::retry_after`] from `Retry-After`;
//! - `408`, other `5xx`, a connection broken mid-exchange → transient, with
//!   `retry_after` from `Retry-After` too;
//! - a timeout after the request was sent (the connection was made, no answer within the
//!   request timeout) → [`PublishError::timed_out_after_send`]: the endpoint is slow, not
//!   down; the router gives the attempt back for the first few and counts the rest;
//! - `Retry-After` is delta-seconds or an HTTP-date (RFC 9110 §10.2.3), capped at
//!   [`MAX_RETRY_AFTER`]. A date is the server's clock, so the delay is that date minus the
//!   response's own `Date` header (§6.6.1); only a response without a parseable `Date`
//!   measures it against this host's clock;
//! - `409` → transient too: with an `Idempotency-Key` it means "a request with this key is
//!   still being processed" (the idempotency-key draft, §2.6), which a later retry resolves;
//! - any other `4xx`, and `3xx` (not followed) → permanent, with the status, its reason
//!   phrase and the length of the response body in the error, never the body itself (an
//!   endpoint may echo the payload back, and the error reaches logs and `last_error`);
//! - connection refused, DNS failure, connect timeout, TLS handshake failure → unavailable
//!   (the endpoint, not the message: the relay gives the attempt back).
//!
//! Request timeout: [`WebhookOptions::timeout`] (10 s by default), or the URL's
//! `outbox_timeout_ms=N` query parameter ([`TIMEOUT_PARAM`]), which is removed from the
//! URL before any request is sent.
//!
//! **One request per message at a time.** Each request runs to its own bound (the request
//! timeout) even when the relay stops waiting for it sooner (its publish timeout): the
//! message is marked sent ([`Confirmations::mark_sent`]) once its request starts, and while
//! that request is outstanding a second publish of the same message sends nothing and gets
//! [`super::ErrorKind::Unavailable`] with code [`super::IN_FLIGHT`] and a `retry_after` of
//! at most 1 s. A `2xx` that arrives after the relay stopped waiting is remembered (for
//! [`LATE_CONFIRMATION_KEEP`], at most [`LATE_CONFIRMATIONS`] messages): the message's next
//! publish is confirmed at once, without another request. So an endpoint slower than the
//! publish timeout receives one copy of a message, not one per retry. (A connect that
//! hangs, a dropped SYN, fails at the connect timeout, the request timeout or 5 s,
//! whichever is shorter; keep the relay's publish timeout above it, so such an endpoint is
//! reported unreachable rather than slow.)
//!
//! What a `2xx` promises is whatever the receiver's handler did before answering; this sink
//! cannot make it stronger. Receivers should persist (or deduplicate on `Idempotency-Key`)
//! before answering `2xx`.

use super::{Confirmations, PublishCode, PublishError, Sink, SinkError};
use crate::cloudevents::{Binding, CloudEvents, EnvelopeFormat, JSON_FORMAT, Mode};
use crate::message::{OutgoingMessage, header};
use crate::redact::{redact_url, redact_url_without_query};
pub use crate::webhook::{SECRET_ENV, SECRET_FILE_ENV, WebhookSecret, WebhookSecretError};
use async_trait::async_trait;
use futures::StreamExt as _;
use reqwest::Url;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use std::borrow::Cow;
use std::collections::HashMap;
use std::time::Duration;

mod response;
mod url;

pub use self::url::{BEARER_FILE_PARAM, ENVELOPE_PARAMS, PARAM_PREFIX, TIMEOUT_PARAM};
use self::url::{take_bearer, take_envelope, take_timeout_param};
pub use response::{ERROR_BODY_BYTES, MAX_RETRY_AFTER};
use response::{classify_error, classify_response};

/// How long a `2xx` that arrived after the relay stopped waiting is remembered.
pub const LATE_CONFIRMATION_KEEP: Duration = Duration::from_secs(3600);
/// The most late `2xx` answers remembered at once (older ones are forgotten first).
pub const LATE_CONFIRMATIONS: usize = 10_000;
/// The longest `retry_after` of a message refused because its earlier request is still
/// outstanding ([`super::IN_FLIGHT`]).
const IN_FLIGHT_RETRY: Duration = Duration::from_secs(1);

/// Settings of the webhook sink.
#[derive(Debug, Clone)]
pub struct WebhookOptions {
    /// Bound on one request, from connecting to the end of the response headers and the
    /// (bounded) read of its body (default 10 s). Keep it at or below the relay's publish
    /// timeout, which bounds the whole batch (and, with routes, below the destination
    /// timeout). The URL's [`TIMEOUT_PARAM`] (`?outbox_timeout_ms=N`), when present,
    /// replaces it.
    pub timeout: Duration,
    /// Requests in flight at once within one batch (default 32; at least 1). With HTTP/1.1
    /// each is a connection of its own, kept alive for the next batch.
    pub max_in_flight: usize,
    /// Signing key; `None` sends unsigned requests.
    pub secret: Option<WebhookSecret>,
}

impl Default for WebhookOptions {
    fn default() -> Self {
        WebhookOptions {
            timeout: Duration::from_secs(10),
            max_in_flight: 32,
            secret: None,
        }
    }
}

impl WebhookOptions {
    /// Defaults, with the secret from the environment ([`WebhookSecret::from_env`]).
    ///
    /// # Errors
    /// As [`WebhookSecret::from_env`].
    pub fn from_env() -> Result<Self, WebhookSecretError> {
        Ok(WebhookOptions {
            secret: WebhookSecret::from_env()?,
            ..WebhookOptions::default()
        })
    }
}

/// Posts each message to an HTTP endpoint and waits for its `2xx`.
pub struct WebhookSink {
    client: reqwest::Client,
    url: Url,
    describe: String,
    secret: Option<WebhookSecret>,
    timeout: Duration,
    max_in_flight: usize,
    envelope: EnvelopeFormat,
    /// Requests outstanding, by message id: the request's number and when it reaches its
    /// bound.
    outstanding: Outstanding,
    /// The next request's number (tells one request of a message from the next).
    requests: std::sync::atomic::AtomicU64,
    /// Messages whose `2xx` came after the relay stopped waiting, and when.
    late: std::sync::Arc<std::sync::Mutex<HashMap<uuid::Uuid, tokio::time::Instant>>>,
}

impl std::fmt::Debug for WebhookSink {
    /// The description only, as logs show it: no credentials (see [`Sink::describe`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("WebhookSink")
            .field(&self.describe())
            .finish()
    }
}

type Outstanding =
    std::sync::Arc<std::sync::Mutex<HashMap<uuid::Uuid, (u64, tokio::time::Instant)>>>;

/// Removes a message's request from the outstanding ones when it ends (or its task is
/// dropped), unless a later request of the message has replaced it.
struct OutstandingGuard {
    outstanding: Outstanding,
    id: uuid::Uuid,
    request: u64,
}

/// Ends request `request` of message `id`, unless a later one has replaced it.
fn end_request(outstanding: &Outstanding, id: uuid::Uuid, request: u64) {
    let mut outstanding = lock(outstanding);
    if outstanding.get(&id).is_some_and(|(r, _)| *r == request) {
        outstanding.remove(&id);
    }
}

impl Drop for OutstandingGuard {
    fn drop(&mut self) {
        end_request(&self.outstanding, self.id, self.request);
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl WebhookSink {
    /// Builds the sink for endpoint `url` with [`WebhookOptions::from_env`]: the secret is
    /// read now, from [`SECRET_ENV`] or [`SECRET_FILE_ENV`]. Nothing is sent yet: an
    /// endpoint that is down makes publishes fail as unavailable, not this call.
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] for a URL that is not `http(s)://HOST…`;
    /// [`SinkError::Open`] for an unusable secret or a client that cannot be built.
    pub async fn connect(url: &str) -> Result<Self, SinkError> {
        let options = WebhookOptions::from_env().map_err(|e| SinkError::Open {
            url: redact_url_without_query(url),
            source: Box::new(e),
        })?;
        Self::connect_with(url, options).await
    }

    /// As [`WebhookSink::connect`] with explicit options (the environment is not read).
    ///
    /// # Errors
    /// As [`WebhookSink::connect`].
    pub async fn connect_with(url: &str, options: WebhookOptions) -> Result<Self, SinkError> {
        let invalid = |reason: String| SinkError::InvalidUrl {
            url: redact_url_without_query(url),
            reason,
        };
        let mut parsed = Url::parse(url).map_err(|e| invalid(e.to_string()))?;
        let timeout_param = take_timeout_param(&mut parsed).map_err(invalid)?;
        let files = super::tls::take_prefixed(&mut parsed, PARAM_PREFIX)
            .map_err(|e| invalid(e.to_string()))?;
        let bearer = take_bearer(&mut parsed).map_err(|e| invalid(e.to_string()))?;
        let envelope = take_envelope(&mut parsed).map_err(invalid)?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(invalid("the scheme must be http or https".into()));
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(invalid("the URL has no host".into()));
        }
        install_ring_provider();
        let open_error = |e: Box<dyn std::error::Error + Send + Sync>| SinkError::Open {
            url: redact_url_without_query(url),
            source: e,
        };
        let tls = if parsed.scheme() == "https" {
            let config =
                std::sync::Arc::new(files.client_config().map_err(|e| invalid(e.to_string()))?);
            let host = parsed.host_str().unwrap_or_default().to_owned();
            let port = parsed.port_or_known_default().unwrap_or(443);
            super::tls::check_handshake(
                &host,
                port,
                config.clone(),
                super::tls::Preamble::None,
                files.ca.as_deref(),
            )
            .await
            .map_err(|e| open_error(Box::new(e)))?;
            Some(config)
        } else if files.named() {
            return Err(invalid(format!(
                "{PARAM_PREFIX}ca, {PARAM_PREFIX}cert and {PARAM_PREFIX}key need an https:// URL"
            )));
        } else {
            None
        };
        let timeout = timeout_param
            .unwrap_or(options.timeout)
            .max(Duration::from_millis(1));
        let max_in_flight = options.max_in_flight.max(1);
        let mut builder = reqwest::Client::builder();
        if let Some(config) = tls {
            builder = builder.tls_backend_preconfigured((*config).clone());
        }
        if let Some(token) = bearer {
            let mut value = HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| invalid("the bearer token is not a valid HTTP header value".into()))?;
            value.set_sensitive(true);
            builder = builder.default_headers(HeaderMap::from_iter([(
                reqwest::header::AUTHORIZATION,
                value,
            )]));
        }
        let client = builder
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(max_in_flight)
            .user_agent(concat!("outbox/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| open_error(Box::new(e.without_url())))?;
        Ok(WebhookSink {
            client,
            // The endpoint as requested (outbox's own parameters taken out), so the same
            // endpoint has the same hash whatever its timeout or TLS settings.
            describe: format!("{}{}", redact_url(parsed.as_str()), envelope.describe()),
            envelope,
            url: parsed,
            secret: options.secret,
            timeout,
            max_in_flight,
            outstanding: Default::default(),
            requests: std::sync::atomic::AtomicU64::new(0),
            late: Default::default(),
        })
    }

    /// True when requests are signed.
    pub fn is_signed(&self) -> bool {
        self.secret.is_some()
    }

    /// The request headers and body of `m` in this sink's envelope, signed when a secret
    /// is set (over the body sent).
    fn request(&self, m: &OutgoingMessage) -> Result<(HeaderMap, bytes::Bytes), PublishError> {
        let (mut h, body) = match self.envelope.cloudevents() {
            None => (Self::headers(m)?, m.payload.clone()),
            Some(ce) => Self::cloudevents(ce, m)?,
        };
        let id = m.message_id.to_string();
        let id_value = HeaderValue::from_str(&id)
            .map_err(|_| PublishError::permanent("message id is not a header value"))?;
        h.insert(HeaderName::from_static("idempotency-key"), id_value.clone());
        if let Some(secret) = &self.secret {
            let ts = chrono::Utc::now().timestamp();
            let sig = secret.sign(&id, ts, &body);
            h.insert(HeaderName::from_static("webhook-id"), id_value);
            h.insert(
                HeaderName::from_static("webhook-timestamp"),
                HeaderValue::from(ts),
            );
            h.insert(
                HeaderName::from_static("webhook-signature"),
                HeaderValue::from_str(&sig)
                    .map_err(|_| PublishError::permanent("signature is not a header value"))?,
            );
        }
        Ok((h, body))
    }

    /// The HTTP binding's binary mode (`ce-` headers, `Content-Type` = `datacontenttype`,
    /// none without one) or structured mode (the JSON event).
    fn cloudevents(
        ce: &CloudEvents,
        m: &OutgoingMessage,
    ) -> Result<(HeaderMap, bytes::Bytes), PublishError> {
        let event = ce.event(m)?;
        let mut h = HeaderMap::with_capacity(event.attributes.len() + 5);
        match ce.mode() {
            Mode::Binary => {
                for (name, value) in event.binary_headers(Binding::Http) {
                    // Lower-case names of a-z 0-9 and `ce-`, percent-encoded values:
                    // always valid, but never panic on it.
                    let (Ok(n), Ok(v)) = (
                        HeaderName::from_bytes(name.as_bytes()),
                        HeaderValue::from_str(&value),
                    ) else {
                        return Err(PublishError::permanent(format!(
                            "attribute header {name:?} has no valid HTTP form"
                        ))
                        .with_code(PublishCode::InvalidHeader));
                    };
                    h.append(n, v);
                }
                if let Some(ct) = &event.datacontenttype {
                    let v = HeaderValue::from_str(ct).map_err(|_| {
                        PublishError::permanent(format!(
                            "the content-type header {ct:?} is not a valid HTTP header value (printable ASCII)"
                        ))
                        .with_code(PublishCode::InvalidHeader)
                    })?;
                    h.insert(CONTENT_TYPE, v);
                }
                Ok((h, event.data.clone()))
            }
            Mode::Structured => {
                h.insert(CONTENT_TYPE, HeaderValue::from_static(JSON_FORMAT));
                Ok((h, bytes::Bytes::from(event.to_json())))
            }
        }
    }

    fn headers(m: &OutgoingMessage) -> Result<HeaderMap, PublishError> {
        let envelope = m.envelope_headers();
        let mut h = HeaderMap::with_capacity(envelope.len() + 5);
        let content_type = envelope
            .iter()
            .find(|(n, _)| *n == header::CONTENT_TYPE)
            .or_else(|| {
                envelope
                    .iter()
                    .find(|(n, _)| n.eq_ignore_ascii_case(header::CONTENT_TYPE))
            })
            .map_or("application/octet-stream", |(_, v)| v.as_str());
        // A media type is ASCII (RFC 9110 §8.3.1); `HeaderValue` alone would pass Latin-1.
        let ct = Some(content_type)
            .filter(|v| v.is_ascii())
            .and_then(|v| HeaderValue::from_str(v).ok())
            .ok_or_else(|| {
                PublishError::permanent(format!(
                    "the content-type header {content_type:?} is not a valid HTTP header value (printable ASCII)"
                )).with_code(PublishCode::InvalidHeader)
            })?;
        h.insert(CONTENT_TYPE, ct);
        let mut seen = std::collections::HashSet::with_capacity(envelope.len());
        for (name, value) in &envelope {
            // HTTP names are case-insensitive: `Tenant` and `tenant` (or a stored
            // `Message-Id` beside the envelope's `message-id`) would arrive as one header.
            if !seen.insert(name.to_ascii_lowercase()) {
                return Err(PublishError::permanent(format!(
                    "header {name:?} is the same HTTP header as another of the message (HTTP header names are case-insensitive)"
                )).with_code(PublishCode::InvalidHeader));
            }
            if name.eq_ignore_ascii_case(header::CONTENT_TYPE) {
                continue;
            }
            if crate::webhook::TRANSPORT_HEADERS
                .iter()
                .any(|f| name.eq_ignore_ascii_case(f))
            {
                return Err(PublishError::permanent(format!(
                    "header {name:?} cannot be sent as an HTTP header: HTTP, a client, a proxy or the webhook sink sets it"
                )).with_code(PublishCode::InvalidHeader));
            }
            let n = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                PublishError::permanent(format!("header name {name:?} is not an HTTP token"))
                    .with_code(PublishCode::InvalidHeader)
            })?;
            let encoded = encode_header_value(value);
            let v = HeaderValue::from_str(&encoded).map_err(|_| {
                PublishError::permanent(format!("header {name:?} has no valid HTTP encoding"))
                    .with_code(PublishCode::InvalidHeader)
            })?;
            h.append(n, v);
        }
        Ok(h)
    }

    /// Posts `m` (slot `i` of `confirm`, marked sent once the request starts); see the
    /// module docs for "one request per message at a time".
    async fn post(
        &self,
        m: &OutgoingMessage,
        confirm: &Confirmations,
        i: usize,
    ) -> Result<(), PublishError> {
        let id = m.message_id;
        if let Some(at) = lock(&self.late).remove(&id)
            && at.elapsed() < LATE_CONFIRMATION_KEEP
        {
            tracing::debug!(sink = %self.describe, message_id = %id, "confirmed by a 2xx that came after the relay stopped waiting");
            return Ok(());
        }
        let (headers, body) = self.request(m)?;
        let guard = {
            let mut outstanding = lock(&self.outstanding);
            if let Some((_, until)) = outstanding.get(&id) {
                let rest = until.saturating_duration_since(tokio::time::Instant::now());
                return Err(PublishError::unavailable(format!(
                    "an earlier request for this message to {} is still outstanding (up to {rest:?} more): not sending a second copy",
                    self.describe
                ))
                .with_code(PublishCode::InFlight)
                .with_retry_after(rest.clamp(Duration::from_millis(10), IN_FLIGHT_RETRY)));
            }
            let request = self
                .requests
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            outstanding.insert(id, (request, tokio::time::Instant::now() + self.timeout));
            OutstandingGuard {
                outstanding: self.outstanding.clone(),
                id,
                request,
            }
        };
        let request_number = guard.request;
        let request = self
            .client
            .post(self.url.clone())
            .headers(headers)
            .body(body);
        let (describe, timeout, late) = (self.describe.clone(), self.timeout, self.late.clone());
        let (tx, rx) = tokio::sync::oneshot::channel();
        // The request runs to its own bound even when this future is dropped (the relay's
        // publish timeout): the message stays outstanding until then.
        tokio::spawn(async move {
            let result = match request.send().await {
                Err(e) => Err(classify_error(e, &describe, timeout)),
                Ok(resp) => classify_response(resp).await,
            };
            if let Err(Ok(())) = tx.send(result) {
                let mut late = lock(&late);
                if late.len() >= LATE_CONFIRMATIONS {
                    late.retain(|_, at| at.elapsed() < LATE_CONFIRMATION_KEEP);
                    if late.len() >= LATE_CONFIRMATIONS
                        && let Some(oldest) =
                            late.iter().min_by_key(|(_, at)| **at).map(|(id, _)| *id)
                    {
                        late.remove(&oldest);
                    }
                }
                late.insert(guard.id, tokio::time::Instant::now());
            }
            // Late answer recorded before the message stops being outstanding.
            drop(guard);
        });
        confirm.mark_sent(i);
        let result = rx.await;
        // The request has ended (its task may not have finished tidying up). Not when this
        // future is dropped first: then the request stays outstanding until its task ends.
        end_request(&self.outstanding, id, request_number);
        let result = result.unwrap_or_else(|_| {
            Err(PublishError::transient(format!(
                "the request to {} ended without an outcome",
                self.describe
            ))
            .with_code(PublishCode::NoOutcome))
        });
        if let Err(e) = &result {
            tracing::debug!(sink = %self.describe, message_id = %m.message_id, topic = %m.topic.escape_debug(), error = %e, "webhook delivery failed");
        }
        result
    }
}

/// Percent-encodes what an HTTP header value cannot carry as it is (see the module docs):
/// `%`, bytes below 0x20, DEL, bytes above 0x7E, and a leading or trailing space.
fn encode_header_value(v: &str) -> Cow<'_, str> {
    let bytes = v.as_bytes();
    let last = bytes.len().saturating_sub(1);
    let needs = |i: usize, b: u8| {
        b == b'%' || !(0x20..0x7f).contains(&b) || (b == b' ' && (i == 0 || i == last))
    };
    if !bytes.iter().enumerate().any(|(i, &b)| needs(i, b)) {
        return Cow::Borrowed(v);
    }
    let mut out = String::with_capacity(v.len() + 16);
    for (i, &b) in bytes.iter().enumerate() {
        if needs(i, b) {
            out.push_str(&format!("%{b:02X}"));
        } else {
            out.push(char::from(b));
        }
    }
    Cow::Owned(out)
}

/// The workspace's one rustls provider, ring (async-nats enables it; with a second provider
/// compiled in, rustls cannot pick a process default and panics at first use): reqwest's
/// `rustls-no-provider` build takes the process default, so install it before building a
/// client. A provider already installed (by us or the host application) is kept.
fn install_ring_provider() {
    let _ = crate::crypto::ring_provider().install_default();
}

#[async_trait]
impl Sink for WebhookSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        // Collected first: a lazy `map` closure in the stream trips the `Send` check of
        // `async_trait`'s boxed future (higher-ranked lifetime inference). Each outcome is
        // recorded as soon as its response is in.
        let posts: Vec<_> = batch
            .iter()
            .enumerate()
            .map(|(i, m)| async move {
                let r = self.post(m, confirm, i).await;
                confirm.set(i, r);
            })
            .collect();
        futures::stream::iter(posts)
            .buffer_unordered(self.max_in_flight)
            .collect::<Vec<()>>()
            .await;
    }

    fn describe(&self) -> String {
        if self.secret.is_some() {
            format!("webhook {} (signed)", self.describe)
        } else {
            format!("webhook {}", self.describe)
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_the_standard_webhooks_test_vector() {
        // From the reference libraries' tests (libraries/go/webhook_test.go, TestWebhookSign).
        let key = WebhookSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "test").unwrap();
        let sig = key.sign(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1_614_265_330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        // The bare base64 form is the same key.
        assert_eq!(
            WebhookSecret::parse("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "t").unwrap(),
            key
        );
    }

    #[test]
    fn secrets_are_validated_and_never_printed() {
        assert!(matches!(
            WebhookSecret::parse("whsec_not base64!", "X"),
            Err(WebhookSecretError::NotBase64 { .. })
        ));
        assert!(matches!(
            WebhookSecret::parse("whsec_", "X"),
            Err(WebhookSecretError::Empty { .. })
        ));
        let e = WebhookSecret::parse("whsec_c2VjcmV0!!", "OUTBOX_WEBHOOK_SECRET").unwrap_err();
        assert!(!e.to_string().contains("c2VjcmV0"), "{e}");
        let k = WebhookSecret::parse("whsec_c2VjcmV0", "X").unwrap();
        assert!(!format!("{k:?}").contains("c2VjcmV0"));
        let opts = format!(
            "{:?}",
            WebhookOptions {
                secret: Some(k),
                ..Default::default()
            }
        );
        assert!(
            opts.contains("<redacted>") && !opts.contains("115, 101"),
            "{opts}"
        );
    }

    #[test]
    fn secret_comes_from_the_variable_or_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "whsec_c2VjcmV0\n").unwrap();
        let p = path.display().to_string();
        let from_file = WebhookSecret::from_lookup(|n| (n == SECRET_FILE_ENV).then(|| p.clone()))
            .unwrap()
            .unwrap();
        assert_eq!(from_file, WebhookSecret::from_bytes(b"secret".to_vec()));
        let inline =
            WebhookSecret::from_lookup(|n| (n == SECRET_ENV).then(|| "whsec_c2VjcmV0".into()))
                .unwrap()
                .unwrap();
        assert_eq!(inline, from_file);
        assert!(WebhookSecret::from_lookup(|_| None).unwrap().is_none());
        assert!(matches!(
            WebhookSecret::from_lookup(|_| Some("whsec_c2VjcmV0".into())),
            Err(WebhookSecretError::Ambiguous)
        ));
        assert!(matches!(
            WebhookSecret::from_lookup(|n| (n == SECRET_FILE_ENV).then(|| "/nonexistent/x".into())),
            Err(WebhookSecretError::File { .. })
        ));
    }

    #[test]
    fn header_values_are_percent_encoded_only_where_needed() {
        assert_eq!(encode_header_value("00-abc-01"), "00-abc-01");
        assert_eq!(encode_header_value("Acme Corp"), "Acme Corp");
        assert_eq!(encode_header_value("grüße"), "gr%C3%BC%C3%9Fe");
        assert_eq!(encode_header_value("100%"), "100%25");
        assert_eq!(encode_header_value(" a\tb "), "%20a%09b%20");
        assert_eq!(encode_header_value("a\r\nb"), "a%0D%0Ab");
        assert_eq!(encode_header_value(""), "");
        assert_eq!(encode_header_value(" "), "%20");
    }

    #[tokio::test]
    async fn descriptions_hide_credentials_and_queries() {
        let sink = WebhookSink::connect_with(
            "https://user:pw@hooks.example.com:8443/in?token=abc#x",
            WebhookOptions::default(),
        )
        .await
        .unwrap();
        let d = sink.describe();
        assert!(
            d.starts_with("webhook https://user:***@hooks.example.com:8443/…#"),
            "{d}"
        );
        assert!(!d.contains("/in") && !d.contains("abc"), "{d}");
        // Plain http: nothing is dialled at connect. The path's secret never shows, and
        // outbox's own parameters do not change the hash.
        let slack = |url: &'static str| async move {
            WebhookSink::connect_with(url, WebhookOptions::default())
                .await
                .unwrap()
                .describe()
        };
        let d = slack("http://hooks.slack.com/services/T000/B000/XXXXSECRET?outbox_timeout_ms=500")
            .await;
        assert!(d.starts_with("webhook http://hooks.slack.com/…#"), "{d}");
        assert!(!d.contains("XXXXSECRET"), "{d}");
        assert_eq!(
            d,
            slack("http://hooks.slack.com/services/T000/B000/XXXXSECRET").await
        );
        let e = WebhookSink::connect_with("http://u:pw@[bad/x?t=1", WebhookOptions::default())
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(!e.contains("pw") && !e.contains("t=1"), "{e}");
    }
}
