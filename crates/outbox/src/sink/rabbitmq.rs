//! RabbitMQ sink (AMQP 0-9-1, lapin).
//!
//! URL: `amqp://USER:PASS@HOST:PORT/VHOST[?exchange=NAME][&max_message_bytes=N][&envelope=…][&ce_source=…]` (the
//! vhost percent-encoded: `%2f` is `/`). `exchange` defaults to `""`, the default exchange,
//! which routes a message to the queue named like its routing key. The URL may also carry
//! lapin's own parameters `frame_max`, `channel_max`, `heartbeat` (seconds),
//! `connection_timeout` (milliseconds) and `auth_mechanism`; anything else is refused.
//! `amqps://` is TLS (default port 5671), trusting the system's roots and the `ca=PATH`
//! bundle; `cert=PATH&key=PATH` is the client identity (for the `EXTERNAL` mechanism or
//! mutual TLS beside a password) and `password_file=PATH` the password (see
//! [`super::tls`]).
//!
//! - Routing key = topic. Every message is published with `mandatory` set, persistent
//!   (`delivery_mode` 2), `message_id` = message id, `timestamp` = occurred-at in whole
//!   seconds (the unit of the AMQP `timestamp` property), `content_type` from the
//!   `content-type` header when present, and the whole envelope
//!   ([`OutgoingMessage::envelope_headers`]) in the `headers` table, every value a long
//!   string (so non-ASCII text arrives as its UTF-8 bytes). Consumers deduplicate on
//!   `message_id`.
//! - Control topics: on the default exchange (`exchange` unset or empty; `amq.default`
//!   is taken as its name too) the routing key names the queue
//!   (<https://www.rabbitmq.com/tutorials/amqp-concepts#exchange-default>), and queue names
//!   starting with `amq.` are the broker's
//!   (<https://www.rabbitmq.com/docs/queues#names>): server-named exclusive queues
//!   (`amq.gen-…`, often another client's reply queue) and the direct reply-to
//!   pseudo-queue `amq.rabbitmq.reply-to…`
//!   (<https://www.rabbitmq.com/docs/direct-reply-to>). A topic starting with `amq.` is
//!   then refused permanently with the code [`CONTROL_TOPIC`](super::CONTROL_TOPIC),
//!   before anything is sent and also while the broker is down, so a producer cannot
//!   inject messages into queues it does not own. Through a named exchange the routing key
//!   only matches bindings and `amq.` means nothing there: it is sent. The exchange itself
//!   comes from the URL, never from a message (a publish to one of the broker's internal
//!   `amq.rabbitmq.` exchanges is refused by the broker, `403 ACCESS_REFUSED`: permanent).
//! - `envelope=cloudevents` (and `ce_source=URI-reference`; [`crate::cloudevents`]): the
//!   AMQP binding's binary mode instead of the envelope headers: the attributes in the
//!   `headers` table (RabbitMQ's form of AMQP application properties) as
//!   `cloudEvents:specversion`, `cloudEvents:id`, `cloudEvents:source`, `cloudEvents:type`,
//!   `cloudEvents:time`, … (long strings, the canonical string form; the `:` separator of
//!   binding 1.0.2, which later drafts keep beside `_`), `content_type` =
//!   `datacontenttype`. `envelope=cloudevents-structured`: `content_type` =
//!   `application/cloudevents+json`, the JSON event as the body, no headers. `message_id`
//!   and `timestamp` stay; the size limit counts what is sent (the JSON event, the
//!   attributes).
//! - Confirmed = the broker's publisher confirm (`basic.ack`) after `confirm.select`
//!   (<https://www.rabbitmq.com/docs/confirms#publisher-confirms>). For a persistent message
//!   routed to a durable classic or quorum queue, RabbitMQ acks only once the message is
//!   written to disk (it batches fsyncs, so pipelining matters); a message routed to no
//!   queue is acked at once. With `mandatory`, such an unroutable message first comes back
//!   as `basic.return` (`312 NO_ROUTE`) and then is acked: that is reported as a
//!   [permanent](super::ErrorKind::Permanent) error, never as success. A `basic.nack` (an
//!   internal error in a queue process, or a full queue with `overflow` set to
//!   `reject-publish`) is transient.
//! - A batch is pipelined on a channel of its own (batches in flight at once use one
//!   channel each, on one connection): every publish is sent in batch order, then every
//!   confirm awaited. A `basic.return` is matched to its message by the `message_id` it
//!   carries, not by the confirm lapin attaches it to: with RabbitMQ's `multiple` acks,
//!   lapin 4 attaches it to an arbitrary confirm of the acked range.
//! - Size: a message whose [`OutgoingMessage::size`] (payload + topic + key + headers)
//!   exceeds `max_message_bytes` is permanent without being sent. The default is 128 MiB,
//!   RabbitMQ 3.8–3.13's default `max_message_size`; RabbitMQ 4.0 lowered the default to
//!   16 MiB, so set `max_message_bytes` to the server's value
//!   (<https://www.rabbitmq.com/docs/configure#config-items>). Should the server refuse a
//!   message anyway (it closes the channel with `406 PRECONDITION_FAILED message size N is
//!   larger than configured max size M`), the messages over M are permanent, the rest of
//!   the batch unavailable, and M is used for later batches. Headers must fit into one frame
//!   (the connection's negotiated `frame_max`, 128 KiB by default): larger ones are
//!   permanent too.
//! - Connection: made lazily and kept. A broker that is down at [`RabbitMqSink::connect`]
//!   does not fail it; each batch then retries the connection and, while it fails, reports
//!   every message [unavailable](super::ErrorKind::Unavailable) (the relay gives the attempt
//!   back). A broken connection or channel (I/O error, missed heartbeats, a channel closed
//!   by the broker, a batch abandoned by the relay's timeout) is dropped and re-made on the
//!   next batch. A missing exchange is unavailable (the operator creates it; the messages
//!   are not at fault); `ACCESS_REFUSED` is permanent.
//! - A broker under a memory or disk alarm blocks publishers: confirms stop arriving and
//!   the relay's publish timeout reports the batch unavailable.
//!
//! Payloads never appear in logs; [`Sink::describe`] omits the credentials.

use super::{Confirmations, PublishCode, PublishError, Sink, SinkError};
use crate::cloudevents::{Binding, ENVELOPE_PARAM, EnvelopeFormat, SOURCE_PARAM};
use crate::message::OutgoingMessage;
use crate::redact::redact_url as redact;
use async_trait::async_trait;
use bytes::Bytes;
use futures::future::{MaybeDone, join_all, maybe_done};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind,
    ExchangeKind,
};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Duration;
use tokio::sync::Mutex;

/// RabbitMQ's default `max_message_size` from 3.8 to 3.13, in bytes (128 MiB). RabbitMQ
/// 4.0 lowered its default to 16 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 128 * 1024 * 1024;

/// Longest AMQP short string (exchange names, routing keys, header names), in bytes.
const MAX_SHORT_STRING: usize = 255;

/// Settings of the RabbitMQ sink; [`RabbitMqSink::connect`] reads them from the URL.
#[derive(Debug, Clone)]
pub struct RabbitMqOptions {
    /// The exchange every message is published to (`""`: the default exchange).
    pub exchange: String,
    /// Largest [`OutgoingMessage::size`] sent, in bytes (default
    /// [`DEFAULT_MAX_MESSAGE_BYTES`]); larger messages are permanent failures.
    pub max_message_bytes: usize,
    /// Bound on making a connection and its channel (default 5 s). Keep it below the
    /// relay's publish timeout.
    pub connect_timeout: Duration,
}

impl Default for RabbitMqOptions {
    fn default() -> Self {
        RabbitMqOptions {
            exchange: String::new(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// Publishes to a RabbitMQ exchange and waits for each publisher confirm.
pub struct RabbitMqSink {
    uri: AMQPUri,
    /// The CA bundle and client identity for `amqps://`.
    tls: lapin::tcp::OwnedTLSConfig,
    exchange: ShortString,
    options: RabbitMqOptions,
    link: Mutex<Option<Arc<Link>>>,
    /// The server's `max_message_size`, once a refusal told us (0: unknown).
    server_max: AtomicUsize,
    describe: String,
    /// The envelope the URL asks for (`envelope=`, `ce_source=`).
    envelope: EnvelopeFormat,
}

impl std::fmt::Debug for RabbitMqSink {
    /// The description only, as logs show it: no credentials (see [`Sink::describe`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RabbitMqSink")
            .field(&self.describe())
            .finish()
    }
}

/// Idle channels kept per connection (one per batch in flight is what is needed).
const MAX_IDLE_CHANNELS: usize = 8;

/// One connection and its idle confirm-mode channels.
///
/// A batch has a channel to itself while it is in flight: lapin hands a `basic.return` to
/// whichever confirm it resolves next (with RabbitMQ's `multiple` acks, an arbitrary one),
/// and a channel shared by two batches would also let one batch's delivery tags and frames
/// interleave with the other's. On a channel of its own, every return during a batch
/// belongs to that batch, and the returned message's `message_id` names the message.
struct Link {
    /// Kept so the connection lives as long as the link; dropping it closes the socket.
    connection: Connection,
    /// Confirm-mode channels no batch is using.
    idle: std::sync::Mutex<Vec<Channel>>,
    /// Negotiated `frame_max`, in bytes.
    frame_max: usize,
    /// Set when a batch saw this link fail, or was abandoned mid-way.
    broken: AtomicBool,
}

impl Link {
    fn usable(&self) -> bool {
        !self.broken.load(Ordering::Relaxed) && self.connection.status().connected()
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Channel>> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An idle channel, or a new one in confirm mode.
    async fn checkout(&self) -> Result<Channel, lapin::Error> {
        loop {
            let Some(channel) = self.idle().pop() else {
                break;
            };
            if channel.status().connected() {
                return Ok(channel);
            }
        }
        let channel = self.connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(channel)
    }

    /// Gives back a channel whose batch completed without a channel error.
    fn checkin(&self, channel: Channel) {
        let mut idle = self.idle();
        if channel.status().connected() && idle.len() < MAX_IDLE_CHANNELS {
            idle.push(channel);
        }
    }
}

/// Marks a link broken unless disarmed: a batch dropped mid-way (the relay's timeout)
/// leaves confirms in flight whose fate is unknown.
struct BreakOnDrop<'a> {
    link: &'a Link,
    armed: bool,
}

impl Drop for BreakOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.link.broken.store(true, Ordering::Relaxed);
        }
    }
}

impl RabbitMqSink {
    /// Reads `url` (see the module docs) and tries to connect. A broker that cannot be
    /// reached is not an error here: it is logged, and each batch retries the connection.
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] when the URL cannot be parsed, uses `amqps://`, carries an
    /// unknown parameter, or names an exchange longer than 255 bytes.
    pub async fn connect(url: &str) -> Result<Self, SinkError> {
        let options = parse_url(url)?.options;
        Self::connect_with(url, options).await
    }

    /// As [`RabbitMqSink::connect`], with settings given in code (the URL's own
    /// `exchange` and `max_message_bytes`, if any, are replaced by `options`).
    ///
    /// # Errors
    /// As [`RabbitMqSink::connect`].
    pub async fn connect_with(url: &str, options: RabbitMqOptions) -> Result<Self, SinkError> {
        let ParsedUrl {
            uri,
            files,
            envelope,
            ..
        } = parse_url(url)?;
        let invalid = |reason: String| SinkError::InvalidUrl {
            url: redact(url),
            reason,
        };
        let mut tls = lapin::tcp::OwnedTLSConfig::default();
        if uri.scheme == AMQPScheme::AMQPS {
            super::tls::install_provider();
            let config = Arc::new(files.client_config().map_err(|e| invalid(e.to_string()))?);
            tls.cert_chain = files
                .ca_pem()
                .map_err(|e| invalid(e.to_string()))?
                .map(|pem| String::from_utf8_lossy(&pem).into_owned());
            tls.identity = files
                .identity_pem()
                .map_err(|e| invalid(e.to_string()))?
                .map(|(pem, key)| lapin::tcp::OwnedIdentity::PKCS8 { pem, key });
            super::tls::check_handshake(
                &uri.authority.host,
                uri.authority.port,
                config,
                super::tls::Preamble::None,
                files.ca.as_deref(),
            )
            .await
            .map_err(|e| SinkError::Open {
                url: redact(url),
                source: Box::new(e),
            })?;
        } else if files.named() {
            return Err(invalid("ca, cert and key need an amqps:// URL".into()));
        }
        let mut sink = Self::with_options(uri, options, url)?;
        sink.tls = tls;
        sink.describe.push_str(&envelope.describe());
        sink.envelope = envelope;
        if let Err(e) = sink.link().await {
            // Credentials never get better by retrying: say so now.
            if e.to_string().contains("ACCESS_REFUSED") {
                return Err(SinkError::Open {
                    url: redact(url),
                    source: format!("RabbitMQ refused the credentials: {e}").into(),
                });
            }
            if sink.uri.scheme == AMQPScheme::AMQP
                && super::tls::speaks_tls(&sink.uri.authority.host, sink.uri.authority.port).await
            {
                return Err(SinkError::Open {
                    url: redact(url),
                    source: format!(
                        "{}:{} speaks TLS: use amqps:// ({e})",
                        sink.uri.authority.host, sink.uri.authority.port
                    )
                    .into(),
                });
            }
            tracing::warn!(sink = %sink.describe, error = %e, "RabbitMQ not reachable yet; each batch will retry");
        }
        Ok(sink)
    }

    fn with_options(uri: AMQPUri, options: RabbitMqOptions, url: &str) -> Result<Self, SinkError> {
        let exchange =
            ShortString::try_new(options.exchange.clone()).map_err(|e| SinkError::InvalidUrl {
                url: redact(url),
                reason: format!("exchange name: {e}"),
            })?;
        let host = &uri.authority.host;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.clone()
        };
        let describe = format!(
            "{}://{host}:{}/{} exchange {:?}",
            if uri.scheme == AMQPScheme::AMQPS {
                "amqps"
            } else {
                "amqp"
            },
            uri.authority.port,
            uri.vhost.replace('%', "%25").replace('/', "%2f"),
            options.exchange
        );
        Ok(RabbitMqSink {
            uri,
            tls: lapin::tcp::OwnedTLSConfig::default(),
            exchange,
            options,
            link: Mutex::new(None),
            server_max: AtomicUsize::new(0),
            describe,
            envelope: EnvelopeFormat::Outbox,
        })
    }

    /// The current link, or a new one when there is none or it broke.
    async fn link(&self) -> Result<Arc<Link>, PublishError> {
        let mut slot = self.link.lock().await;
        if let Some(link) = slot.as_ref() {
            if link.usable() {
                return Ok(link.clone());
            }
            tracing::info!(sink = %self.describe, "RabbitMQ connection or channel broken; reconnecting");
        }
        // Dropping the last handle of the old connection closes it.
        *slot = None;
        let link = tokio::time::timeout(self.options.connect_timeout, self.open_link())
            .await
            .map_err(|_| {
                PublishError::unavailable(format!(
                    "connecting to {} timed out after {:?}",
                    self.describe, self.options.connect_timeout
                ))
                .with_code(PublishCode::NotConnected)
            })??;
        let link = Arc::new(link);
        *slot = Some(link.clone());
        Ok(link)
    }

    async fn open_link(&self) -> Result<Link, PublishError> {
        let unavailable = |what: &str, e: lapin::Error| {
            PublishError::unavailable(format!("{what} {}: {e}", self.describe))
        };
        let props = ConnectionProperties::default().with_connection_name("outbox relay".into());
        let runtime =
            lapin::runtime::default_runtime().map_err(|e| unavailable("no runtime for", e))?;
        let connection =
            lapin::Connect::connect_with_config(self.uri.clone(), props, self.tls.clone(), runtime)
                .await
                .map_err(|e| unavailable("cannot connect to", e))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| unavailable("cannot open a channel on", e))?;
        if !self.exchange.as_str().is_empty() {
            // Passive: only checks that the exchange exists (a missing one closes the channel
            // with 404, which would fail every publish of the batch).
            let passive = ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            };
            channel
                .exchange_declare(
                    self.exchange.clone(),
                    ExchangeKind::Direct,
                    passive,
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    PublishError::unavailable(format!(
                        "exchange {:?} is not usable on {}: {e}",
                        self.options.exchange, self.describe
                    ))
                    .with_code(PublishCode::NoDestination)
                })?;
        }
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| unavailable("cannot enable publisher confirms on", e))?;
        let frame_max = match connection.configuration().frame_max() {
            0 => usize::MAX, // 0 = no limit
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        Ok(Link {
            connection,
            idle: std::sync::Mutex::new(vec![channel]),
            frame_max,
            broken: AtomicBool::new(false),
        })
    }

    /// The size limit in force: the configured one, or the server's when it told us a
    /// smaller one.
    fn max_message_bytes(&self) -> usize {
        match self.server_max.load(Ordering::Relaxed) {
            0 => self.options.max_message_bytes,
            n => n.min(self.options.max_message_bytes),
        }
    }

    /// The permanent [`CONTROL_TOPIC`](super::CONTROL_TOPIC) error of a topic that would
    /// name one of the broker's `amq.` queues (see the module docs).
    fn control_topic_error(&self, topic: &str) -> Option<PublishError> {
        control_routing_key(&self.options.exchange, topic)
            .map(|why| PublishError::control_topic(topic, why))
    }

    /// Routing key, properties and body of `m`, or why it cannot be sent.
    fn prepare(
        &self,
        m: &OutgoingMessage,
        frame_max: usize,
    ) -> Result<(ShortString, BasicProperties, Bytes), PublishError> {
        if let Some(e) = self.control_topic_error(&m.topic) {
            return Err(e);
        }
        let limit = self.max_message_bytes();
        // The envelope's header pairs, its content type and body.
        let (pairs, content_type, body) = self.envelope.properties(m, Binding::Amqp)?;
        let size = match self.envelope {
            EnvelopeFormat::Outbox => m.size(),
            EnvelopeFormat::CloudEvents(_) => {
                body.len()
                    + m.topic.len()
                    + pairs.iter().map(|(n, v)| n.len() + v.len()).sum::<usize>()
            }
        };
        if size > limit {
            return Err(PublishError::permanent(format!(
                "message of {size} bytes (payload, topic, key and headers) exceeds the RabbitMQ limit of {limit} bytes"
            ))
            .with_code(PublishCode::TooLarge));
        }
        let routing_key = ShortString::try_new(m.topic.clone()).map_err(|_| {
            PublishError::permanent(format!(
                "topic of {} bytes is longer than an AMQP routing key may be ({MAX_SHORT_STRING})",
                m.topic.len()
            ))
            .with_code(PublishCode::InvalidTopic)
        })?;
        let mut table = FieldTable::default();
        // Bytes of the content header frame: frame overhead 8, class/weight/body size/flags
        // 14, then each property.
        let mut header_bytes = 8 + 14 + 1 + 8 + 1 + 36;
        let content_type = content_type.and_then(|ct| ShortString::try_new(ct).ok());
        for (name, value) in pairs {
            let len = name.len();
            header_bytes += 1 + len + 1 + 4 + value.len();
            let key = ShortString::try_new(name).map_err(|_| {
                PublishError::permanent(format!(
                    "header name of {len} bytes is longer than AMQP allows ({MAX_SHORT_STRING})"
                ))
                .with_code(PublishCode::InvalidHeader)
            })?;
            table.insert(key, AMQPValue::LongString(LongString::from(value)));
        }
        header_bytes += 4;
        if let Some(ct) = &content_type {
            header_bytes += 1 + ct.as_str().len();
        }
        if header_bytes > frame_max {
            return Err(PublishError::permanent(format!(
                "the envelope headers need a {header_bytes}-byte AMQP content header, more than the connection's frame_max of {frame_max} bytes"
            )).with_code(PublishCode::TooLarge));
        }
        let mut props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(ShortString::from(m.message_id.to_string()))
            .with_timestamp(u64::try_from(m.occurred_at.timestamp()).unwrap_or(0));
        if !table.inner().is_empty() {
            props = props.with_headers(table);
        }
        if let Some(ct) = content_type {
            props = props.with_content_type(ct);
        }
        Ok((routing_key, props, body))
    }

    /// What a failed publish or confirm means for message `m`.
    fn classify(&self, e: &lapin::Error, m: &OutgoingMessage) -> PublishError {
        match e.kind() {
            ErrorKind::ProtocolError(amqp) => {
                let text = amqp.get_message().as_str();
                match amqp.kind() {
                    AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => {
                        PublishError::unavailable(format!(
                            "exchange {:?} not found on {}: {text}",
                            self.options.exchange, self.describe
                        ))
                        .with_code(PublishCode::NoDestination)
                    }
                    AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => {
                        PublishError::permanent(format!("RabbitMQ refused access: {text}"))
                            .with_code(PublishCode::NotAuthorized)
                    }
                    AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => {
                        match server_max_from(text) {
                            Some(max) => {
                                self.server_max.store(max, Ordering::Relaxed);
                                if m.payload.len() > max {
                                    PublishError::permanent(format!(
                                        "payload of {} bytes exceeds the RabbitMQ server's max_message_size of {max} bytes",
                                        m.payload.len()
                                    )).with_code(PublishCode::TooLarge)
                                } else {
                                    PublishError::unavailable(format!(
                                        "channel closed by RabbitMQ because of another message of the batch: {text}"
                                    ))
                                }
                            }
                            None => PublishError::transient(format!("RabbitMQ: {text}")),
                        }
                    }
                    // 311 content-too-large (AMQP 0-9-1 §1.9 constants): this message.
                    AMQPErrorKind::Soft(AMQPSoftError::CONTENTTOOLARGE) => {
                        PublishError::permanent(format!("RabbitMQ refused the message: {text}"))
                            .with_code(PublishCode::Rejected)
                    }
                    // 405 resource-locked and the rest: a later try may work.
                    AMQPErrorKind::Soft(_) => PublishError::transient(format!("RabbitMQ: {text}")),
                    AMQPErrorKind::Hard(_) => {
                        PublishError::unavailable(format!("RabbitMQ closed the connection: {text}"))
                            .with_code(PublishCode::NotConnected)
                    }
                }
            }
            ErrorKind::IOError(_)
            | ErrorKind::RuntimeShutdownError(_)
            | ErrorKind::InvalidConnectionState(_)
            | ErrorKind::InvalidChannelState(..)
            | ErrorKind::InvalidChannel(_)
            | ErrorKind::MissingHeartbeatError
            | ErrorKind::ParsingError(_) => {
                PublishError::unavailable(format!("connection to {} failed: {e}", self.describe))
                    .with_code(PublishCode::NotConnected)
            }
            _ => PublishError::transient(format!("RabbitMQ publish: {e}")),
        }
    }
}

#[async_trait]
impl Sink for RabbitMqSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        if batch.is_empty() {
            return;
        }
        // Control topics are refused first: permanent even while the broker is down
        // (`prepare` refuses them again, so they are never sent).
        for (i, m) in batch.iter().enumerate() {
            if let Some(e) = self.control_topic_error(&m.topic) {
                confirm.set(i, Err(e));
            }
        }
        let link = match self.link().await {
            Ok(link) => link,
            Err(e) => {
                confirm.fail_unset(&e);
                return;
            }
        };
        // Armed until the outcomes are in: a batch dropped before that (the relay's timeout)
        // leaves the link in an unknown state.
        let mut guard = BreakOnDrop {
            link: &link,
            armed: true,
        };
        let channel = match link.checkout().await {
            Ok(channel) => channel,
            Err(e) => {
                let e = PublishError::unavailable(format!(
                    "cannot open a channel on {}: {e}",
                    self.describe
                ))
                .with_code(PublishCode::NotConnected);
                confirm.fail_unset(&e);
                return;
            }
        };
        let channel = &channel;
        let exchange = &self.exchange;
        let sends: Vec<_> = batch
            .iter()
            .map(|m| {
                let prepared = self.prepare(m, link.frame_max);
                async move {
                    let (routing_key, props, body) = prepared.map_err(Failure::Refused)?;
                    let options = BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    };
                    let confirm = channel
                        .basic_publish(exchange.clone(), routing_key, options, &body, props)
                        .await
                        .map_err(Failure::Broker)?;
                    confirm.await.map_err(Failure::Broker)
                }
            })
            .collect();
        let outcomes = send_in_order(sends).await;

        // Returns, by the message id they carry (see `Link`): whichever confirm lapin
        // attached one to, it belongs to the message with that id.
        let mut returns: HashMap<String, (u16, String)> = HashMap::new();
        let outcomes: Vec<Option<Result<Confirmed, Failure>>> = outcomes
            .into_iter()
            .zip(batch)
            .map(|(outcome, m)| {
                let confirmation = match outcome {
                    Some(Ok(c)) => c,
                    Some(Err(e)) => return Some(Err(e)),
                    None => return None,
                };
                let confirmed = match &confirmation {
                    Confirmation::Ack(_) => Confirmed::Ack,
                    Confirmation::Nack(_) => Confirmed::Nack,
                    Confirmation::NotRequested => Confirmed::NotRequested,
                };
                if let Some(ret) = confirmation.take_message() {
                    let id = ret
                        .delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map_or_else(|| m.message_id.to_string(), ToString::to_string);
                    returns.insert(id, (ret.reply_code, ret.reply_text.as_str().to_owned()));
                }
                Some(Ok(confirmed))
            })
            .collect();

        // Recorded once every confirm is in: lapin may attach a returned message to
        // another message's confirm, so an ack means "routed" only when no return for
        // that message id came back in the whole batch.
        let mut broken = false;
        for (i, (m, outcome)) in batch.iter().zip(outcomes).enumerate() {
            let returned = returns.get(&m.message_id.to_string());
            confirm.set(i, match (outcome, returned) {
                (None, _) => Err(PublishError::transient("no publisher confirm outcome")),
                (Some(Ok(Confirmed::Ack | Confirmed::Nack)), Some((code, text))) => {
                    Err(PublishError::permanent(format!(
                        "unroutable: no queue bound for routing key {:?} on exchange {:?} (basic.return {code} {text})",
                        m.topic, self.options.exchange,
                    ))
                    .with_code(PublishCode::Unroutable))
                }
                (Some(Ok(Confirmed::Ack)), None) => Ok(()),
                (Some(Ok(Confirmed::Nack)), None) => Err(PublishError::transient(
                    "RabbitMQ nacked the message (a queue could not take it: internal error, or full with overflow reject-publish)",
                )
                .with_code(PublishCode::Nack)),
                (Some(Ok(Confirmed::NotRequested)), _) => {
                    broken = true;
                    Err(PublishError::transient(
                        "the channel was not in confirm mode; reconnecting",
                    ))
                }
                (Some(Err(Failure::Refused(e))), _) => Err(e),
                (Some(Err(Failure::Broker(e))), _) => {
                    broken = true;
                    Err(self.classify(&e, m))
                }
            });
        }
        if broken {
            link.broken.store(true, Ordering::Relaxed);
        } else {
            link.checkin(channel.clone());
        }
        guard.armed = false;
        drop(guard);
    }

    async fn close(&self) {
        let link = self.link.lock().await.take();
        if let Some(link) = link {
            // Every confirm was awaited or abandoned already; do not wait long for a broker
            // that is going away.
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                link.connection.close(200, "outbox relay stopping".into()),
            )
            .await;
        }
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// The broker's answer to one publish, without the returned message.
enum Confirmed {
    Ack,
    Nack,
    NotRequested,
}

/// Why one publish failed.
enum Failure {
    /// Refused before sending.
    Refused(PublishError),
    /// The broker or the connection failed.
    Broker(lapin::Error),
}

/// Why publishing with `routing_key` to `exchange` would address the broker's own queues,
/// if it would: on the default exchange (`""`, or its name `amq.default`) the routing key
/// is a queue name, and `amq.` queue names are reserved for the broker (server-named
/// queues, direct reply-to).
fn control_routing_key(exchange: &str, routing_key: &str) -> Option<&'static str> {
    let default_exchange = exchange.is_empty() || exchange == "amq.default";
    (default_exchange && routing_key.starts_with("amq.")).then_some(
        "on RabbitMQ's default exchange the topic names a queue, and amq. queues are the broker's (server-named queues such as another client's replies, direct reply-to)",
    )
}

/// Polls every publish once, in batch order, then awaits them all.
///
/// A publish's first poll takes its delivery tag and queues its frames before it waits for
/// anything, so this sends the whole batch, in order, without waiting for any write (the
/// pipelining).
async fn send_in_order<F, T>(futures: Vec<F>) -> Vec<Option<T>>
where
    F: Future<Output = T>,
{
    let mut futures: Vec<Pin<Box<MaybeDone<F>>>> = futures
        .into_iter()
        .map(|f| Box::pin(maybe_done(f)))
        .collect();
    std::future::poll_fn(|cx| {
        for f in &mut futures {
            let _ = f.as_mut().poll(cx);
        }
        Poll::Ready(())
    })
    .await;
    join_all(futures.iter_mut().map(|f| f.as_mut())).await;
    futures
        .iter_mut()
        .map(|f| f.as_mut().take_output())
        .collect()
}

/// The `M` of RabbitMQ's "message size N is larger than configured max size M".
fn server_max_from(text: &str) -> Option<usize> {
    let rest = text.split("larger than configured max size ").nth(1)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Query parameters lapin itself reads from an AMQP URI.
const LAPIN_PARAMS: [&str; 5] = [
    "frame_max",
    "channel_max",
    "heartbeat",
    "connection_timeout",
    "auth_mechanism",
];

/// Splits our parameters off `url` and parses the rest as lapin's URI; the TLS files and
/// the password of `password_file` (put into the URI) come out first.
fn parse_url(url: &str) -> Result<ParsedUrl, SinkError> {
    let invalid = |reason: String| SinkError::InvalidUrl {
        url: redact(url),
        reason,
    };
    let original = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    let mut parsed = original.clone();
    let files = super::tls::take_settings(&mut parsed).map_err(|e| invalid(e.to_string()))?;
    // The text as written unless a parameter was taken out (lapin reads the vhost from it).
    let cleaned = parsed.to_string();
    let url = if parsed == original {
        url
    } else {
        cleaned.as_str()
    };
    let base = url.split_once('?').map_or(url, |(base, _)| base);
    // Decoded as a form (`+` is a space); what is not UTF-8 once decoded comes out as
    // U+FFFD, refused for the values this sink reads.
    let decoded =
        |v: std::borrow::Cow<'_, str>| Some(v.into_owned()).filter(|v| !v.contains('\u{FFFD}'));
    let mut options = RabbitMqOptions::default();
    let mut kept = url::form_urlencoded::Serializer::new(String::new());
    let mut envelope = None;
    let mut source = None;
    for (k, v) in parsed.query_pairs() {
        match k.as_ref() {
            ENVELOPE_PARAM | SOURCE_PARAM => {
                let v = decoded(v)
                    .ok_or_else(|| invalid(format!("{k} is not valid percent-encoded UTF-8")))?;
                if k == ENVELOPE_PARAM {
                    envelope = Some(v);
                } else {
                    source = Some(v);
                }
            }
            "exchange" => {
                options.exchange = decoded(v.clone()).ok_or_else(|| {
                    invalid(format!("exchange {v:?} is not valid percent-encoded UTF-8"))
                })?;
            }
            "max_message_bytes" => {
                options.max_message_bytes = v.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    invalid(format!("max_message_bytes {v:?} is not a positive integer"))
                })?;
            }
            k if LAPIN_PARAMS.contains(&k) => {
                kept.append_pair(k, &v);
            }
            k => {
                return Err(invalid(format!(
                    "unknown parameter {k:?} (known: exchange, max_message_bytes, envelope, ce_source, {})",
                    LAPIN_PARAMS.join(", ")
                )));
            }
        }
    }
    let envelope = EnvelopeFormat::parse(Binding::Amqp, "", envelope.as_deref(), source.as_deref())
        .map_err(invalid)?;
    let kept = kept.finish();
    let lapin_url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{kept}")
    };
    let mut uri = AMQPUri::from_str(&lapin_url).map_err(invalid)?;
    if uri.scheme != AMQPScheme::AMQP && uri.scheme != AMQPScheme::AMQPS {
        return Err(invalid("only amqp:// and amqps:// are supported".into()));
    }
    // lapin takes the host from the URL's domain only, so an IP address would silently
    // become "localhost": put the literal address back.
    if let Some(ip) = ip_host(base) {
        uri.authority.host = ip;
    }
    Ok(ParsedUrl {
        uri,
        options,
        files,
        envelope,
    })
}

/// What [`parse_url`] reads from a sink URL.
struct ParsedUrl {
    uri: AMQPUri,
    options: RabbitMqOptions,
    files: super::tls::TlsFiles,
    envelope: EnvelopeFormat,
}

/// The host of `url` when it is an IP address literal (IPv6 without brackets).
fn ip_host(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?']).next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = if let Some(v6) = host_port.strip_prefix('[') {
        v6.split(']').next()?
    } else {
        host_port.split(':').next()?
    };
    host.parse::<std::net::IpAddr>()
        .ok()
        .map(|ip| ip.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn amq_queues_are_control_topics_on_the_default_exchange_only() {
        for exchange in ["", "amq.default"] {
            for key in [
                "amq.gen-JzTY20BRgKO-HjmUJj0wLg",
                "amq.rabbitmq.reply-to",
                "amq.",
            ] {
                assert!(
                    control_routing_key(exchange, key).is_some(),
                    "{exchange:?} {key:?}"
                );
            }
            assert!(control_routing_key(exchange, "orders.placed").is_none());
            assert!(control_routing_key(exchange, "AMQ.gen").is_none());
        }
        assert!(control_routing_key("events", "amq.gen-x").is_none());
        assert!(control_routing_key("amq.topic", "amq.x").is_none());
    }

    #[test]
    fn url_parameters_are_split_off() {
        let ParsedUrl {
            uri,
            options: o,
            envelope,
            ..
        } = parse_url(
            "amqp://u:p@127.0.0.1:5673/%2f?exchange=ev%2Eout&heartbeat=10&max_message_bytes=1000",
        )
        .unwrap();
        assert_eq!(envelope, EnvelopeFormat::Outbox);
        assert_eq!(o.exchange, "ev.out");
        assert_eq!(o.max_message_bytes, 1000);
        assert_eq!(uri.authority.host, "127.0.0.1");
        assert_eq!(uri.authority.port, 5673);
        assert_eq!(uri.vhost, "/");
        assert_eq!(uri.query.heartbeat, Some(10));
        let o = parse_url("amqp://h/v").unwrap().options;
        assert_eq!(o.exchange, "");
        assert_eq!(o.max_message_bytes, DEFAULT_MAX_MESSAGE_BYTES);
        assert!(parse_url("amqp://h/v?exchnage=x").is_err());
        // A form's decoding: `+` is a space; bytes that are not UTF-8 are refused.
        let ParsedUrl { uri, options, .. } =
            parse_url("amqp://h/v?exchange=a+b%2Bc&heartbeat=5&frame_max=8192").unwrap();
        assert_eq!(options.exchange, "a b+c");
        assert_eq!(
            (uri.query.heartbeat, uri.query.frame_max),
            (Some(5), Some(8192))
        );
        let e = parse_url("amqp://h/v?exchange=%FF")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("is not valid percent-encoded UTF-8"), "{e}");
        let ParsedUrl { uri, files, .. } = parse_url("amqps://h/v?ca=/ca.pem&exchange=x").unwrap();
        assert_eq!(uri.scheme, AMQPScheme::AMQPS);
        assert_eq!(uri.authority.port, 5671);
        assert_eq!(files.ca.as_deref(), Some(std::path::Path::new("/ca.pem")));
        assert!(parse_url("amqp://h/v?max_message_bytes=0").is_err());
        let uri = parse_url("amqp://[::1]:5672/%2f").unwrap().uri;
        assert_eq!(uri.authority.host, "::1");
        let ce = parse_url("amqp://h/v?envelope=cloudevents&ce_source=%2Fshop%2Forders&exchange=x")
            .unwrap();
        let settings = ce.envelope.cloudevents().unwrap();
        assert_eq!(settings.mode(), crate::cloudevents::Mode::Binary);
        assert_eq!(settings.source(), "/shop/orders");
        assert_eq!(ce.options.exchange, "x");
        assert!(parse_url("amqp://h/v?envelope=cloudevents-structured").is_ok());
        assert!(parse_url("amqp://h/v?envelope=json").is_err());
        assert!(parse_url("amqp://h/v?ce_source=%2Fx").is_err());
    }

    #[test]
    fn redacts_credentials_and_reads_server_limits() {
        assert_eq!(redact("amqp://u:secret@h:1/v"), "amqp://u:***@h:1/v");
        assert_eq!(
            server_max_from(
                "PRECONDITION_FAILED - message size 2000 is larger than configured max size 1024"
            ),
            Some(1024)
        );
        assert_eq!(
            server_max_from("PRECONDITION_FAILED - something else"),
            None
        );
    }
}
