//! MQTT v5 (Mosquitto on 1883): a topic tree of its own per instance and a subscriber
//! (QoS 1) on it from before the first publish; the envelope from the user properties.

use super::{Harness, Received, closed_port};
use crate::common::unique;
use async_trait::async_trait;
use outbox::sink::mqtt::{MqttSink, MqttSinkOptions};
use outbox::sink::{Sink, SinkError};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, Publish};
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The machine's Mosquitto; `OUTBOX_TEST_MQTT_URL` overrides it.
pub(crate) fn broker_url() -> String {
    std::env::var("OUTBOX_TEST_MQTT_URL").unwrap_or_else(|_| "mqtt://127.0.0.1:1883".into())
}

pub(crate) fn host_port(url: &str) -> (String, u16) {
    let rest = url.split_once("://").unwrap().1;
    let hostport = rest.split(['/', '?']).next().unwrap();
    let (h, p) = hostport.rsplit_once(':').unwrap();
    (h.to_owned(), p.parse().unwrap())
}

/// Fails loudly, saying how to start Mosquitto, when it is not reachable.
pub(crate) async fn require_broker() -> String {
    let url = broker_url();
    let (h, p) = host_port(&url);
    if let Err(e) = tokio::net::TcpStream::connect((h.as_str(), p)).await {
        panic!(
            "Mosquitto is not reachable at {url} ({e}). Start it with \
             `mosquitto -d -c /etc/mosquitto/mosquitto.conf` (Debian package mosquitto; the \
             config must have `listener 1883 127.0.0.1` and `allow_anonymous true`). Set \
             OUTBOX_TEST_MQTT_URL to use another broker."
        );
    }
    url
}

/// A rumqttc v5 subscriber forwarding every publish it receives.
pub(crate) struct Subscriber {
    rx: mpsc::UnboundedReceiver<Publish>,
    task: tokio::task::JoinHandle<()>,
}

impl Subscriber {
    pub(crate) async fn start(url: &str, filter: &str, qos: QoS) -> Self {
        let (host, port) = host_port(url);
        let mut o = MqttOptions::new(format!("test-sub-{}", unique()), host, port);
        o.set_max_packet_size(Some(4 * 1024 * 1024));
        let (client, mut el) = AsyncClient::new(o, 100);
        client.subscribe(filter, qos).await.unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let (subscribed_tx, subscribed_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let _client = client; // keeps the request channel open
            let mut subscribed = Some(subscribed_tx);
            loop {
                match el.poll().await {
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let _ = tx.send(p);
                    }
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        if let Some(s) = subscribed.take() {
                            let _ = s.send(());
                        }
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(5), subscribed_rx)
            .await
            .expect("no SUBACK within 5 s")
            .unwrap();
        Subscriber { rx, task }
    }

    /// The next `n` publishes, or a panic after `timeout`.
    pub(crate) async fn take(&mut self, n: usize, timeout: Duration) -> Vec<Publish> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(p)) => out.push(p),
                _ => panic!("received {}/{n} messages within {timeout:?}", out.len()),
            }
        }
        out
    }

    /// Whatever else arrives within `grace`.
    pub(crate) async fn extra(&mut self, grace: Duration) -> Vec<Publish> {
        let mut out = Vec::new();
        let deadline = Instant::now() + grace;
        while let Ok(Some(p)) = tokio::time::timeout(
            deadline.saturating_duration_since(Instant::now()),
            self.rx.recv(),
        )
        .await
        {
            out.push(p);
        }
        out
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A publish read back with the library's decoder.
pub(crate) fn received(p: &Publish) -> Received {
    Received::from(outbox::envelope::from_mqtt(p).unwrap())
}

/// `ENVELOPE`: [`super::OUTBOX`], [`super::CE`] or [`super::CE_STRUCTURED`].
pub(crate) struct MqttHarness<const ENVELOPE: u8 = { super::OUTBOX }> {
    url: String,
    root: String,
    sub: Subscriber,
    taken: Vec<Received>,
}

#[async_trait]
impl<const ENVELOPE: u8> Harness for MqttHarness<ENVELOPE> {
    const DEDUPLICATES: bool = false;
    const PERMANENT_CODE: &'static str = "invalid_topic";

    async fn setup() -> Self {
        let url = require_broker().await;
        let root = format!("outbox-test/{}", unique());
        let sub = Subscriber::start(&url, &format!("{root}/#"), QoS::AtLeastOnce).await;
        MqttHarness {
            url,
            root,
            sub,
            taken: Vec::new(),
        }
    }

    fn topic(&self, label: &str) -> String {
        format!("{}/{label}.v1", self.root)
    }

    async fn sink(&self) -> Box<dyn Sink> {
        let sink = MqttSink::connect(&super::with_envelope(&self.url, ENVELOPE, ""))
            .await
            .unwrap();
        assert!(sink.is_connected());
        Box::new(sink)
    }

    async fn size_limit(&self) -> Option<usize> {
        None
    }

    async fn read(&mut self, expected: usize) -> Vec<Received> {
        let missing = expected.saturating_sub(self.taken.len());
        let got = self.sub.take(missing, Duration::from_secs(10)).await;
        self.taken.extend(got.iter().map(received));
        let extra = self.sub.extra(Duration::from_millis(300)).await;
        self.taken.extend(extra.iter().map(received));
        self.taken.clone()
    }

    async fn down_sink() -> Result<Box<dyn Sink>, SinkError> {
        let sink = MqttSink::connect_with(
            &format!("mqtt://127.0.0.1:{}", closed_port()),
            MqttSinkOptions {
                initial_connect_wait: Duration::from_millis(300),
                ..MqttSinkOptions::default()
            },
        )
        .await?;
        Ok(Box::new(sink))
    }

    async fn permanent_topic(&mut self) -> String {
        // A wildcard cannot be published to.
        format!("{}/+/bad", self.root)
    }

    async fn cleanup(self) {
        // Nothing is retained; dropping the subscriber ends it.
    }
}
