//! HTTP webhook: an axum endpoint of its own per instance, recording every request; it
//! answers 400 to messages on a topic ending in `.reject`. The envelope comes from the
//! request headers, percent-decoded as the sink documents (or the CloudEvent, in either
//! mode); transport headers are left out.

use super::{Harness, Received, closed_port, poll_read};
use async_trait::async_trait;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use outbox::sink::http::{WebhookOptions, WebhookSink};
use outbox::sink::{Sink, SinkError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The receiver's side of the documented header encoding: a plain percent-decoder.
pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            out.push(
                u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap(), 16).unwrap(),
            );
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

type Requests = Arc<Mutex<Vec<(HeaderMap, Bytes)>>>;

async fn handle(State(reqs): State<Requests>, headers: HeaderMap, body: Bytes) -> StatusCode {
    // The topic as the decoder reads it, whatever the envelope.
    let reject = outbox::envelope::from_webhook(&headers, body.clone())
        .is_ok_and(|e| e.topic.ends_with(".reject"));
    if reject {
        return StatusCode::BAD_REQUEST;
    }
    reqs.lock().unwrap().push((headers, body));
    StatusCode::NO_CONTENT
}

/// A request read back with the library's decoder; `Idempotency-Key` is the message id.
pub(crate) fn received(headers: &HeaderMap, body: &Bytes) -> Received {
    let env = outbox::envelope::from_webhook(headers, body.clone()).unwrap();
    assert_eq!(
        headers.get("idempotency-key").map(|v| v.to_str().unwrap()),
        Some(env.message_id.to_string().as_str()),
        "Idempotency-Key = message id"
    );
    Received::from(env)
}

/// `ENVELOPE`: [`super::OUTBOX`], [`super::CE`] or [`super::CE_STRUCTURED`].
pub(crate) struct HttpHarness<const ENVELOPE: u8 = { super::OUTBOX }> {
    url: String,
    requests: Requests,
    task: tokio::task::JoinHandle<()>,
}

#[async_trait]
impl<const ENVELOPE: u8> Harness for HttpHarness<ENVELOPE> {
    const DEDUPLICATES: bool = false;
    const PERMANENT_CODE: &'static str = "http_4xx";

    async fn setup() -> Self {
        let requests: Requests = Arc::default();
        let app = Router::new()
            .fallback(handle)
            .layer(DefaultBodyLimit::disable())
            .with_state(requests.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        HttpHarness {
            url: super::with_envelope(&format!("http://{addr}/hooks/in"), ENVELOPE, "outbox_"),
            requests,
            task,
        }
    }

    fn topic(&self, label: &str) -> String {
        format!("orders.{label}.v1")
    }

    async fn sink(&self) -> Box<dyn Sink> {
        Box::new(
            WebhookSink::connect_with(&self.url, WebhookOptions::default())
                .await
                .unwrap(),
        )
    }

    async fn size_limit(&self) -> Option<usize> {
        None
    }

    async fn read(&mut self, expected: usize) -> Vec<Received> {
        let requests = self.requests.clone();
        poll_read(
            expected,
            Duration::from_secs(10),
            Duration::from_millis(100),
            || {
                let got: Vec<Received> = requests
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(h, b)| received(h, b))
                    .collect();
                async move { got }
            },
        )
        .await
    }

    async fn down_sink() -> Result<Box<dyn Sink>, SinkError> {
        let url = format!("http://127.0.0.1:{}/in", closed_port());
        Ok(Box::new(
            WebhookSink::connect_with(&url, WebhookOptions::default()).await?,
        ))
    }

    async fn permanent_topic(&mut self) -> String {
        "orders.bad.reject".into()
    }

    async fn cleanup(self) {
        self.task.abort();
    }
}
