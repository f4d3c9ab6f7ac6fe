//! MQTT v5 sink (rumqttc).
//!
//! - URL: `mqtt://[USER[:PASSWORD]@]HOST[:PORT][?qos=1|2&client_id=ID&max_inflight=N&envelope=…&ce_source=…]`
//!   (`mqtts://` for TLS with the system's root certificates; default ports 1883 / 8883).
//!   `qos` defaults to 1 (QoS 0 is refused: nothing would confirm a message);
//!   `client_id` defaults to `outbox-<12 random hex digits>` — give each relay its own,
//!   since a broker disconnects the older of two connections with one client id;
//!   `max_inflight` (default 100) bounds the publishes awaiting their acknowledgement (the
//!   broker's `Receive Maximum` lowers it further). Userinfo, percent-encoded, becomes the
//!   MQTT username and password; `describe()` never shows them.
//! - MQTT topic = the outbox topic, unchanged (dots are ordinary characters in MQTT). A
//!   topic MQTT cannot publish to is refused permanently: empty, containing `+`, `#`, NUL or
//!   other control characters, or longer than 65,535 bytes (code `invalid_topic`). A topic
//!   starting with `$` is the broker's (MQTT v5 §4.7.2: `$SYS/` statistics and control,
//!   `$share/` shared subscriptions, other broker-specific `$` names): it is refused as a
//!   control topic (code [`CONTROL_TOPIC`](super::CONTROL_TOPIC)), before anything is sent
//!   and also while the broker is down. The topic on the wire is the outbox topic
//!   unchanged (no prefix), so the rule applies to it as it is.
//! - Envelope = v5 user properties, in the order of
//!   [`OutgoingMessage::envelope_headers`] (`message-id`, `topic`, `key`, `occurred-at`,
//!   then the stored headers, `content-type` included), with the text unchanged, non-ASCII
//!   included. The `content-type` header also sets the v5 Content Type property. Payload =
//!   the bytes, unchanged. Retain is off.
//! - `envelope=cloudevents` (and `ce_source=URI-reference`; [`crate::cloudevents`]): the
//!   MQTT binding's binary mode instead: user properties named as the attributes
//!   (`specversion`, `id`, `source`, `type`, `time`, `partitionkey`, `traceparent`,
//!   `correlationid`, …), the Content Type property = `datacontenttype`, the payload
//!   unchanged; no `message-id`, `topic`, `key` or `occurred-at` properties.
//!   `envelope=cloudevents-structured`: Content Type = `application/cloudevents+json`, the
//!   JSON event as the payload, no user properties.
//! - MQTT strings may not carry NUL and should not carry control characters or Unicode
//!   non-characters (MQTT v5 §1.5.4, which lets a receiver close the connection over them;
//!   Mosquitto does): a header or topic with one is refused permanently, so one message
//!   cannot break the connection for the others.
//!
//! Confirmed = the message's own acknowledgement: PUBACK for QoS 1, PUBCOMP for QoS 2.
//! rumqttc's `publish` returns when the request is queued, so the sink runs the event loop
//! in a background task and correlates: the event loop takes requests in order and reports
//! each publish's packet id as it goes out (`Outgoing::Publish(pkid)`), then the ack with
//! that packet id settles exactly that message.
//!
//! - A PUBACK/PUBREC reason code ≥ 0x80 fails the message (MQTT v5 §3.4.2.1): `0x87` not
//!   authorized, `0x90` topic name invalid, `0x99` payload format invalid → permanent;
//!   `0x80` unspecified, `0x83` implementation specific, `0x91` packet id in use →
//!   transient; `0x97` quota exceeded → unavailable (the broker's limit, not the
//!   message). `0x10` "no matching subscribers" is a success: the broker
//!   accepted the message, and MQTT keeps nothing for a topic nobody subscribes to (only
//!   persistent sessions subscribed beforehand receive it later). Subscribe before
//!   publishing, with a persistent session (clean start off) where consumers may be offline.
//! - A message larger than the broker's `Maximum Packet Size` (from its CONNACK; Mosquitto's
//!   `max_packet_size`) is refused permanently before it is sent. Reason code 0x95 "packet
//!   too large" cannot arrive in a PUBACK: MQTT v5 does not define it there and rumqttc
//!   drops the connection when it sees it (Mosquitto sends it for a payload over its older
//!   `message_size_limit`); see the next point.
//! - The connection down, or lost with acknowledgements pending → unavailable (the relay
//!   gives the attempt back). The exception: when the broker dropped the connection over
//!   something it was sent (an acknowledgement rumqttc cannot parse, or a DISCONNECT for a
//!   malformed packet, protocol error, invalid topic, packet too large or payload format),
//!   the unacknowledged messages fail as *transient*, so a message that breaks the
//!   connection every time uses up its attempts and is quarantined rather than retried
//!   forever (the others sent with it usually succeed on their next attempt).
//! - The sink reconnects on its own (100 ms doubling to 2 s), with a clean session:
//!   publishes of a lost connection are never replayed by the client; the relay publishes
//!   them again (at least once). Keep-alive is 5 s, so a silent connection is noticed
//!   within about 10 s. `connect` does not fail when the broker is down. A refused QoS 2
//!   publish (PUBREC ≥ 0x80) also resets the connection, since rumqttc would otherwise
//!   keep its in-flight slot forever; messages in flight with it are unavailable.
//! - What an acknowledgement promises depends on the broker: Mosquitto acknowledges once
//!   the message is queued in memory for the current subscribers and writes its
//!   persistence file only periodically (`autosave_interval`, default 30 min) or on
//!   shutdown; a crash in between loses acknowledged messages queued for offline
//!   subscribers. Lower `autosave_interval` (or `autosave_on_changes`) to narrow the window.

use super::{Confirmations, PublishCode, PublishError, Sink, SinkError};
use crate::cloudevents::EnvelopeFormat;
use crate::message::OutgoingMessage;
use crate::redact::redact_url_without_query;
use async_trait::async_trait;
use futures::future::join_all;
use rumqttc::Outgoing;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, PubCompReason, Publish};
use rumqttc::v5::{AsyncClient, ConnectionError, Event, EventLoop, MqttOptions, StateError};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot, watch};
use tokio_util::sync::CancellationToken;

mod ack;
mod prepare;
mod url;

use self::url::parse_url;
use ack::{AckReason, ack_failure};
use prepare::{control_topic_error, prepare};

/// Largest MQTT packet (the variable byte integer's limit, MQTT v5 §1.5.5), used when the
/// broker announces no `Maximum Packet Size`.
const MQTT_MAX_PACKET: u64 = 268_435_455;
/// Longest MQTT UTF-8 string (§1.5.4).
const MQTT_MAX_STRING: usize = 65_535;

/// Text an MQTT UTF-8 string may carry (MQTT v5 §1.5.4): no NUL, no C0/C1 control
/// characters, no Unicode non-characters.
fn is_mqtt_string(s: &str) -> bool {
    s.chars().all(|c| {
        let u = u32::from(c);
        !(u <= 0x1f || (0x7f..=0x9f).contains(&u) || (0xfdd0..=0xfdef).contains(&u))
            && (u & 0xfffe) != 0xfffe
    })
}

/// Settings of the MQTT sink beyond the URL.
#[derive(Debug, Clone)]
pub struct MqttSinkOptions {
    /// How long a publish waits for its acknowledgement before it counts as unavailable
    /// (default 10 s). Keep it at or below the relay's publish timeout.
    pub ack_timeout: Duration,
    /// How long `connect` waits for the first connection before returning anyway
    /// (default 2 s).
    pub initial_connect_wait: Duration,
}

impl Default for MqttSinkOptions {
    fn default() -> Self {
        MqttSinkOptions {
            ack_timeout: Duration::from_secs(10),
            initial_connect_wait: Duration::from_secs(2),
        }
    }
}

/// Publishes to an MQTT v5 broker and waits for each message's own PUBACK (QoS 1) or
/// PUBCOMP (QoS 2).
pub struct MqttSink {
    client: AsyncClient,
    shared: Arc<Shared>,
    permits: Arc<Semaphore>,
    qos: QoS,
    ack_timeout: Duration,
    describe: String,
    envelope: EnvelopeFormat,
    cancel: CancellationToken,
    driver: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for MqttSink {
    /// The description only, as logs show it: no credentials (see [`Sink::describe`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MqttSink").field(&self.describe()).finish()
    }
}

type Outcome = Result<(), PublishError>;

/// One publish handed to rumqttc whose acknowledgement has not arrived; holds its in-flight
/// permit until settled.
struct Waiter {
    tx: oneshot::Sender<Outcome>,
    _permit: OwnedSemaphorePermit,
}

impl Waiter {
    fn settle(self, outcome: Outcome) {
        // The publisher may have stopped waiting (ack timeout, relay timeout): nothing to do.
        let _ = self.tx.send(outcome);
    }
}

/// Connection state shared by the publishers and the event-loop task. Publishers hand a
/// request to rumqttc and queue its waiter under the same lock, so `waiting` is in the
/// order rumqttc sends them.
struct Conn {
    connected: bool,
    down_reason: String,
    max_packet_size: Option<u32>,
    max_qos: Option<u8>,
    /// Requested, packet id not yet known (in request order).
    waiting: VecDeque<Waiter>,
    /// Sent, by packet id.
    inflight: HashMap<u16, Waiter>,
    /// A publish rumqttc holds back because its packet id is still in use (a broker that
    /// acknowledges out of order); it goes out later under that packet id.
    collided: Option<(u16, Waiter)>,
    /// The broker refused the credentials (CONNACK): the reason, for `connect` to report.
    refused: Option<String>,
}

struct Shared {
    conn: Mutex<Conn>,
    connected: watch::Sender<bool>,
}

/// What the event-loop task does after an event.
enum Flow {
    Continue,
    Connected,
    /// Drop the connection (rumqttc leaks an in-flight slot on a failed QoS 2 exchange;
    /// a fresh connection resets its count).
    Reset(String),
    Stop,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Conn> {
        // A panic while holding the lock cannot leave `Conn` inconsistent in a way that
        // matters more than stopping would: keep going with the data.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn on_event(&self, event: Event, el: &mut EventLoop) -> Flow {
        let mut c = self.lock();
        match event {
            Event::Incoming(Packet::ConnAck(ack)) => {
                // Publishes of an earlier connection were failed already: never replay them.
                el.pending.clear();
                c.connected = true;
                c.down_reason.clear();
                let props = ack.properties.as_ref();
                c.max_packet_size = props.and_then(|p| p.max_packet_size);
                c.max_qos = props.and_then(|p| p.max_qos);
                self.connected.send_replace(true);
                Flow::Connected
            }
            Event::Outgoing(Outgoing::Publish(pkid)) => {
                if c.collided.as_ref().is_some_and(|(p, _)| *p == pkid) {
                    if let Some((_, w)) = c.collided.take() {
                        c.inflight.insert(pkid, w);
                    }
                } else if let Some(w) = c.waiting.pop_front()
                    && let Some(old) = c.inflight.insert(pkid, w)
                {
                    // Cannot happen with rumqttc's collision handling; never confirm the
                    // wrong message if it does.
                    old.settle(Err(PublishError::transient(format!(
                        "MQTT packet id {pkid} reused before its acknowledgement"
                    ))));
                }
                Flow::Continue
            }
            Event::Outgoing(Outgoing::AwaitAck(pkid)) => {
                if let Some(w) = c.waiting.pop_front() {
                    c.collided = Some((pkid, w));
                }
                Flow::Continue
            }
            Event::Incoming(Packet::PubAck(ack)) => {
                if let Some(w) = c.inflight.remove(&ack.pkid) {
                    let reason_string = ack.properties.and_then(|p| p.reason_string);
                    w.settle(
                        match ack_failure(AckReason::from(ack.reason), reason_string) {
                            None => Ok(()),
                            Some(e) => Err(e),
                        },
                    );
                }
                Flow::Continue
            }
            Event::Incoming(Packet::PubRec(rec)) => {
                let reason_string = rec.properties.and_then(|p| p.reason_string);
                match ack_failure(AckReason::from(rec.reason), reason_string) {
                    None => Flow::Continue,
                    Some(e) => {
                        if let Some(w) = c.inflight.remove(&rec.pkid) {
                            w.settle(Err(e));
                        }
                        Flow::Reset("reconnecting after a refused QoS 2 publish".into())
                    }
                }
            }
            Event::Incoming(Packet::PubComp(comp)) => {
                let failed = comp.reason != PubCompReason::Success;
                if let Some(w) = c.inflight.remove(&comp.pkid) {
                    w.settle(if failed {
                        Err(PublishError::transient(
                            "the broker completed the QoS 2 exchange with \"packet identifier not found\"",
                        ).with_code(PublishCode::NotConnected))
                    } else {
                        Ok(())
                    });
                }
                if failed {
                    Flow::Reset("reconnecting after a failed QoS 2 completion".into())
                } else {
                    Flow::Continue
                }
            }
            Event::Outgoing(Outgoing::Disconnect) => Flow::Stop,
            _ => Flow::Continue,
        }
    }

    /// The connection is gone (or is being dropped): settle acknowledgements that were
    /// read before the failure, then fail everything else and make sure rumqttc will not
    /// replay any of it. Publishes not yet sent are unavailable; sent ones are unavailable
    /// too, unless `blame_sent`: the broker dropped the connection over something it was
    /// sent, so they fail as transient and their attempts count.
    fn lost(&self, el: &mut EventLoop, reason: &str, blame_sent: bool) {
        while let Some(event) = el.state.events.pop_front() {
            // A Reset or Stop from these stale events changes nothing: we are resetting.
            let _ = self.on_event(event, el);
        }
        let mut c = self.lock();
        c.connected = false;
        c.down_reason = reason.to_owned();
        self.connected.send_replace(false);
        // Under the lock, so no publisher can slip a request in: drop the connection, move
        // what rumqttc still holds (and its queued requests) to `pending`, and discard it.
        el.clean();
        el.pending.clear();
        let e = PublishError::unavailable(reason);
        for w in c.waiting.drain(..) {
            w.settle(Err(e.clone()));
        }
        let sent_error = if blame_sent {
            PublishError::transient(format!(
                "{reason} (the broker dropped the connection while this message was unacknowledged)"
            ))
        } else {
            e.clone()
        };
        for (_, w) in c.inflight.drain() {
            w.settle(Err(sent_error.clone()));
        }
        if let Some((_, w)) = c.collided.take() {
            w.settle(Err(e));
        }
    }
}

enum Slot {
    Done(Outcome),
    Wait(oneshot::Receiver<Outcome>),
}

impl MqttSink {
    /// Connects to `url` (see the module docs for its form) with default
    /// [`MqttSinkOptions`]. The connection is made in the background and kept up: a broker
    /// that is down makes publishes fail as unavailable, it does not fail this call.
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] when the URL cannot be parsed; [`SinkError::Open`] when the
    /// TLS configuration (system root certificates) cannot be built.
    pub async fn connect(url: &str) -> Result<Self, SinkError> {
        Self::connect_with(url, MqttSinkOptions::default()).await
    }

    /// As [`MqttSink::connect`] with explicit options.
    ///
    /// # Errors
    /// As [`MqttSink::connect`].
    pub async fn connect_with(url: &str, options: MqttSinkOptions) -> Result<Self, SinkError> {
        let redacted = redact_url_without_query(url);
        let invalid = |reason: String| SinkError::InvalidUrl {
            url: redacted.clone(),
            reason,
        };
        // The TLS and secret parameters (`ca`, `cert`, `key`, `password_file`) first.
        let mut u = ::url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
        let files = super::tls::take_settings(&mut u).map_err(|e| invalid(e.to_string()))?;
        let cleaned;
        let url = if u.as_str() == url {
            url
        } else {
            cleaned = u.to_string();
            cleaned.as_str()
        };
        let parsed = parse_url(url).map_err(invalid)?;
        if files.named() && !parsed.tls {
            return Err(invalid("ca, cert and key need an mqtts:// URL".into()));
        }
        let client_id = parsed
            .client_id
            .clone()
            .unwrap_or_else(|| format!("outbox-{:012x}", rand::random::<u64>() >> 16));
        let mut opts = MqttOptions::new(client_id.clone(), parsed.host.clone(), parsed.port);
        opts.set_keep_alive(Duration::from_secs(5))
            .set_clean_start(true)
            .set_connection_timeout(5)
            .set_outgoing_inflight_upper_limit(parsed.max_inflight);
        if let Some(user) = &parsed.username {
            opts.set_credentials(user.clone(), parsed.password.clone().unwrap_or_default());
        }
        if parsed.tls {
            install_ring_provider();
            let config = Arc::new(files.client_config().map_err(|e| invalid(e.to_string()))?);
            let host = parsed.host.trim_start_matches('[').trim_end_matches(']');
            super::tls::check_handshake(
                host,
                parsed.port,
                config.clone(),
                super::tls::Preamble::None,
                files.ca.as_deref(),
            )
            .await
            .map_err(|e| SinkError::Open {
                url: redacted.clone(),
                source: Box::new(e),
            })?;
            opts.set_transport(rumqttc::Transport::tls_with_config(
                rumqttc::TlsConfiguration::Rustls(config),
            ));
        }
        let max_inflight = usize::from(parsed.max_inflight);
        // The request channel never holds more than the in-flight permits allow, plus a
        // DISCONNECT at close.
        let (client, eventloop) = AsyncClient::new(opts, max_inflight + 4);
        let (connected_tx, mut connected_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            conn: Mutex::new(Conn {
                connected: false,
                down_reason: format!("not connected to {redacted} yet"),
                max_packet_size: None,
                max_qos: None,
                waiting: VecDeque::new(),
                inflight: HashMap::new(),
                collided: None,
                refused: None,
            }),
            connected: connected_tx,
        });
        let describe = format!(
            "{redacted} (qos {}, client id {client_id}){}",
            qos_number(parsed.qos),
            parsed.envelope.describe()
        );
        let cancel = CancellationToken::new();
        let driver = tokio::spawn(drive(
            eventloop,
            shared.clone(),
            cancel.clone(),
            redacted.clone(),
        ));
        // Give the first connection a moment, so the first batch does not find it still
        // being made; a broker that is down is not an error here.
        let _ =
            tokio::time::timeout(options.initial_connect_wait, connected_rx.wait_for(|c| *c)).await;
        let mut refused = shared.lock().refused.take();
        if refused.is_none()
            && !parsed.tls
            && !*shared.connected.borrow()
            && super::tls::speaks_tls(&parsed.host, parsed.port).await
        {
            refused = Some(format!(
                "{}:{} speaks TLS: use mqtts://",
                parsed.host, parsed.port
            ));
        }
        if let Some(reason) = refused {
            cancel.cancel();
            return Err(SinkError::Open {
                url: redacted,
                source: reason.into(),
            });
        }
        Ok(MqttSink {
            client,
            shared,
            permits: Arc::new(Semaphore::new(max_inflight)),
            qos: parsed.qos,
            ack_timeout: options.ack_timeout,
            describe,
            envelope: parsed.envelope,
            cancel,
            driver: Mutex::new(Some(driver)),
        })
    }

    /// True while connected to the broker.
    pub fn is_connected(&self) -> bool {
        *self.shared.connected.borrow()
    }

    async fn connected_within(&self, wait: Duration) -> bool {
        let mut rx = self.shared.connected.subscribe();
        matches!(
            tokio::time::timeout(wait, rx.wait_for(|c| *c)).await,
            Ok(Ok(_))
        )
    }

    /// Hands one message to rumqttc; the slot settles when its acknowledgement arrives.
    async fn send(&self, m: &OutgoingMessage) -> Slot {
        let prepared = match prepare(m, &self.envelope) {
            Ok(p) => p,
            Err(e) => return Slot::Done(Err(e)),
        };
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            return Slot::Done(Err(PublishError::unavailable("the MQTT sink is closed")
                .with_code(PublishCode::NotConnected)));
        };
        let mut c = self.shared.lock();
        if !c.connected {
            return Slot::Done(Err(PublishError::unavailable(c.down_reason.clone())));
        }
        if self.qos == QoS::ExactlyOnce && c.max_qos.is_some_and(|q| q < 2) {
            return Slot::Done(Err(PublishError::unavailable(format!(
                "the broker {} supports at most QoS {}: use ?qos=1",
                self.describe,
                c.max_qos.unwrap_or_default()
            ))
            .with_code(PublishCode::DestinationDown)));
        }
        let limit = c.max_packet_size.map_or(MQTT_MAX_PACKET, u64::from);
        // Without an announced limit only a payload near MQTT's own one needs measuring.
        if c.max_packet_size.is_some() || prepared.payload.len() as u64 > MQTT_MAX_PACKET / 2 {
            let probe = Publish::new(
                m.topic.as_str(),
                self.qos,
                prepared.payload.clone(),
                Some(prepared.properties.clone()),
            );
            // `size()` counts a packet id only once one is assigned: add its 2 bytes.
            let size = probe.size() as u64 + 2;
            if size > limit {
                return Slot::Done(Err(PublishError::permanent(format!(
                    "the MQTT packet would be {size} bytes, over the broker's maximum packet size of {limit} bytes"
                )).with_code(PublishCode::TooLarge)));
            }
        }
        match self.client.try_publish_with_properties(
            m.topic.as_str(),
            self.qos,
            false,
            prepared.payload,
            prepared.properties,
        ) {
            Ok(()) => {
                let (tx, rx) = oneshot::channel();
                c.waiting.push_back(Waiter {
                    tx,
                    _permit: permit,
                });
                Slot::Wait(rx)
            }
            Err(e) => Slot::Done(Err(PublishError::unavailable(format!(
                "the MQTT client did not take the publish: {e}"
            )))),
        }
    }
}

/// The event-loop task: polls rumqttc (which reconnects when polled after an error) and
/// settles waiters as acknowledgements arrive.
async fn drive(
    mut el: EventLoop,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    describe: String,
) {
    let mut backoff = Duration::from_millis(100);
    let mut was_connected = false;
    let mut failures: u32 = 0;
    loop {
        let polled = tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            r = el.poll() => r,
        };
        match polled {
            Ok(event) => match shared.on_event(event, &mut el) {
                Flow::Continue => {}
                Flow::Connected => {
                    backoff = Duration::from_millis(100);
                    if failures > 0 {
                        tracing::info!(sink = %describe, "MQTT connection restored");
                    }
                    failures = 0;
                    was_connected = true;
                }
                Flow::Reset(reason) => {
                    tracing::warn!(sink = %describe, %reason, "MQTT connection reset");
                    shared.lost(&mut el, &reason, false);
                }
                Flow::Stop => break,
            },
            Err(e) => {
                let reason = format!("MQTT connection to {describe}: {e}");
                if let Some(refusal) = credentials_refused(&e) {
                    shared.lock().refused = Some(refusal);
                }
                shared.lost(&mut el, &reason, blames_sent_messages(&e));
                failures = failures.saturating_add(1);
                // Log the first failure of an outage, then every 100th: never flood.
                if failures == 1 || failures.is_multiple_of(100) {
                    if was_connected {
                        tracing::warn!(sink = %describe, error = %e, failures, "MQTT connection lost; reconnecting");
                    } else {
                        tracing::warn!(sink = %describe, error = %e, failures, "MQTT broker unreachable; retrying");
                    }
                }
                was_connected = false;
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
    shared.lost(&mut el, "the MQTT sink is closed", false);
}

/// The broker's CONNACK refused who we are (user name, password, client certificate):
/// an error that no reconnect will fix.
fn credentials_refused(e: &ConnectionError) -> Option<String> {
    use rumqttc::v5::mqttbytes::v5::ConnectReturnCode as C;
    match e {
        ConnectionError::ConnectionRefused(
            code @ (C::BadUserNamePassword
            | C::NotAuthorized
            | C::BadAuthenticationMethod
            | C::Banned),
        ) => Some(format!("the broker refused the connection: {code:?}")),
        _ => None,
    }
}

/// Did the broker end the connection over something it was sent? It then sent a packet
/// the client cannot parse (Mosquitto answers a payload over its `message_size_limit`
/// with PUBACK reason 0x95, which MQTT v5 does not define for PUBACK and rumqttc rejects),
/// or disconnected with a reason about a packet. The unacknowledged messages then fail as
/// transient, not unavailable: a message that breaks the connection every time uses up its
/// attempts and is quarantined instead of being retried forever.
fn blames_sent_messages(e: &ConnectionError) -> bool {
    use rumqttc::v5::mqttbytes::v5::DisconnectReasonCode as D;
    match e {
        // rumqttc reports socket errors of its codec as "deserialization" errors too: those
        // are the connection's, not a message's.
        ConnectionError::MqttState(StateError::Deserialization(e)) => {
            !matches!(e, rumqttc::v5::mqttbytes::Error::Io(_))
        }
        ConnectionError::MqttState(StateError::ServerDisconnect { reason_code, .. }) => {
            matches!(
                reason_code,
                D::MalformedPacket
                    | D::ProtocolError
                    | D::TopicNameInvalid
                    | D::PacketTooLarge
                    | D::PayloadFormatInvalid
            )
        }
        _ => false,
    }
}

fn qos_number(q: QoS) -> u8 {
    match q {
        QoS::AtMostOnce => 0,
        QoS::AtLeastOnce => 1,
        QoS::ExactlyOnce => 2,
    }
}

/// The workspace's one rustls provider, ring (with a second provider compiled in, rustls
/// cannot pick a process default and panics at first use). A provider already
/// installed (by another sink or the host application) is kept.
fn install_ring_provider() {
    let _ = crate::crypto::ring_provider().install_default();
}

#[async_trait]
impl Sink for MqttSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        // Control topics are refused first: permanent even while the broker is down.
        for (i, m) in batch.iter().enumerate() {
            if let Some(e) = control_topic_error(&m.topic) {
                confirm.set(i, Err(e));
            }
        }
        if !self.connected_within(Duration::from_millis(500)).await {
            let reason = self.shared.lock().down_reason.clone();
            confirm.fail_unset(&PublishError::unavailable(reason));
            return;
        }
        // Hand every publish over first (pipelined, bounded by the in-flight permits),
        // then wait for the acknowledgements.
        let mut slots = Vec::with_capacity(batch.len());
        for m in batch {
            slots.push(self.send(m).await);
        }
        let ack_timeout = self.ack_timeout;
        join_all(slots.into_iter().enumerate().map(|(i, slot)| async move {
            let outcome = match slot {
                Slot::Done(outcome) => outcome,
                Slot::Wait(rx) => match tokio::time::timeout(ack_timeout, rx).await {
                    Ok(Ok(outcome)) => outcome,
                    Ok(Err(_)) => Err(PublishError::unavailable("the MQTT sink is closed")),
                    Err(_) => Err(PublishError::timed_out(format!(
                        "no MQTT acknowledgement within {ack_timeout:?}"
                    ))),
                },
            };
            confirm.set(i, outcome);
        }))
        .await;
    }

    async fn close(&self) {
        // A clean DISCONNECT when connected; never wait long for a broker that is down.
        let driver = self.driver.lock().unwrap_or_else(|p| p.into_inner()).take();
        if self.is_connected() {
            let _ = self.client.try_disconnect();
        } else {
            self.cancel.cancel();
        }
        if let Some(mut handle) = driver
            && tokio::time::timeout(Duration::from_secs(2), &mut handle)
                .await
                .is_err()
        {
            self.cancel.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(1), handle).await;
        }
        self.cancel.cancel();
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

impl Drop for MqttSink {
    fn drop(&mut self) {
        // Stop the background task (and its reconnect attempts) with the sink.
        self.cancel.cancel();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn descriptions_hide_credentials() {
        let options = MqttSinkOptions {
            initial_connect_wait: Duration::ZERO,
            ..MqttSinkOptions::default()
        };
        let sink = MqttSink::connect_with("mqtt://u:secret@127.0.0.1:1?client_id=x", options)
            .await
            .unwrap();
        assert_eq!(
            sink.describe(),
            "mqtt://u:***@127.0.0.1:1 (qos 1, client id x)"
        );
        let e = MqttSink::connect_with("mqtt://u:secret@h?qos=7", MqttSinkOptions::default())
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(!e.contains("secret"), "{e}");
    }
}
