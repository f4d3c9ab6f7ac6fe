//! NATS JetStream: a stream of its own per instance (`common::TestStream`), read back with
//! direct gets of every stored message; the stream deduplicates on `Nats-Msg-Id`.

use super::{Harness, Received, closed_port, poll_read};
use crate::common::{TestStream, nats_connect, nats_url};
use async_trait::async_trait;
use outbox::sink::nats::{NatsOptions, NatsSink};
use outbox::sink::{Sink, SinkError};
use std::time::Duration;

/// `ENVELOPE`: [`super::OUTBOX`] or [`super::CE`] (structured mode, the NATS binding's).
pub(crate) struct NatsHarness<const ENVELOPE: u8 = { super::OUTBOX }> {
    client: async_nats::Client,
    stream: Option<TestStream>,
}

impl<const ENVELOPE: u8> NatsHarness<ENVELOPE> {
    fn stream(&self) -> &TestStream {
        self.stream.as_ref().unwrap()
    }

    /// Every message the stream stores now, in stream order.
    async fn stored(&self) -> Vec<Received> {
        let js = async_nats::jetstream::new(self.client.clone());
        let mut stream = js.get_stream(&self.stream().name).await.unwrap();
        let state = stream.info().await.unwrap().state.clone();
        let mut out = Vec::new();
        if state.messages == 0 {
            return out;
        }
        for seq in state.first_sequence..=state.last_sequence {
            let m = stream.get_raw_message(seq).await.unwrap();
            let msg_id = m.headers.get("Nats-Msg-Id").unwrap().as_str().to_owned();
            let env = outbox::envelope::from_nats_headers(&m.headers, m.payload.clone()).unwrap();
            assert_eq!(
                msg_id,
                env.message_id.to_string(),
                "Nats-Msg-Id = message id"
            );
            assert_eq!(m.subject.as_str(), env.topic, "subject = topic");
            out.push(Received::from(env));
        }
        out
    }
}

#[async_trait]
impl<const ENVELOPE: u8> Harness for NatsHarness<ENVELOPE> {
    const DEDUPLICATES: bool = true;
    const PERMANENT_CODE: &'static str = "no_destination";

    async fn setup() -> Self {
        let client = nats_connect().await;
        let stream = TestStream::shared(&client).await;
        NatsHarness {
            client,
            stream: Some(stream),
        }
    }

    fn topic(&self, label: &str) -> String {
        self.stream().subject(label)
    }

    async fn sink(&self) -> Box<dyn Sink> {
        Box::new(
            NatsSink::connect(
                &super::with_envelope(&nats_url(), ENVELOPE, ""),
                NatsOptions::default(),
            )
            .await
            .unwrap(),
        )
    }

    async fn size_limit(&self) -> Option<usize> {
        let max = self.client.server_info().max_payload;
        (max < 1024 * 1024 + 4096).then_some(max)
    }

    async fn read(&mut self, expected: usize) -> Vec<Received> {
        poll_read(
            expected,
            Duration::from_secs(10),
            Duration::from_millis(200),
            || self.stored(),
        )
        .await
    }

    async fn down_sink() -> Result<Box<dyn Sink>, SinkError> {
        let url = format!("nats://127.0.0.1:{}", closed_port());
        let options = NatsOptions {
            ack_timeout: Duration::from_secs(2),
        };
        Ok(Box::new(NatsSink::connect(&url, options).await?))
    }

    async fn permanent_topic(&mut self) -> String {
        // No stream covers it.
        format!("outbox.nostream.{}", crate::common::unique())
    }

    async fn cleanup(mut self) {
        // The guard deletes the stream.
        drop(self.stream.take());
    }
}
