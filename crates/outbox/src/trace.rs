//! Traces across the outbox: the trace context a message carries, and the producer span
//! the relay opens for each message it publishes.
//!
//! The context travels in two headers, as the W3C Trace Context recommendation defines them
//! (<https://www.w3.org/TR/trace-context/>):
//! - [`crate::message::header::TRACEPARENT`] (`traceparent`): `VERSION-TRACE_ID-PARENT_ID-FLAGS` in
//!   lowercase hex, e.g. `00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01`: version
//!   `00`, a 16-byte trace id, the 8-byte id of the span that sent it, flags (`01` =
//!   sampled);
//! - [`crate::message::header::TRACESTATE`] (`tracestate`): vendor entries, `key=value` separated by commas;
//!   left out when empty.
//!
//! **At enqueue** `Message::with_trace_context` (feature `otel`) copies the context of the current
//! `tracing` span (through `tracing-opentelemetry`) into those headers, so the message
//! belongs to the trace of the request that wrote it. A producer without OpenTelemetry can
//! set them itself ([`crate::Message::trace_context`], `outbox enqueue --header traceparent=…`,
//! or the headers argument of the SQL entry points).
//!
//! **In the relay**, before a batch is published, each message gets a `tracing` span per
//! the OpenTelemetry messaging semantic conventions: name `send {topic}`, `otel.kind =
//! "producer"`, attributes `messaging.system` (`kafka`, `rabbitmq`, `nats`, `redis`,
//! `mqtt`, `http`, `file`), `messaging.operation.type` and `messaging.operation.name`
//! (`send`), `messaging.destination.name` (the topic), `messaging.message.id`,
//! `messaging.message.body.size`, and `outbox.attempt`. Its **parent** is the context
//! stored in the message's `traceparent`/`tracestate` (a message without one starts a new
//! trace): the publish is the message's own send, one span per message, so it belongs in
//! the producer's trace as a child rather than beside it as a link (links are for spans
//! that cover many messages, and backends show a tree far better than a link). The
//! message then goes on the wire with **that span's** `traceparent` and `tracestate`
//! instead of the stored ones, so consumers continue the trace from the relay's span. The
//! stored row keeps the producer's headers: a retry is a new span, a sibling of the
//! first, parented by the producer again.
//!
//! Sampling is the tracer's: with the usual parent-based sampler a context stored as not
//! sampled (flags `00`) gives a span that is not exported, and the message still goes out
//! with that span's id and flags `00`.
//!
//! Each span ends as soon as its message's outcome is known (the broker's confirmation,
//! or the failure); a failure sets the span status to error with the reason and
//! `error.type` to its short code (`nack`, `timeout`, `http_5xx`, `breaker_open`, …, or
//! `no_outcome` when the relay stopped waiting first: shutdown grace, lost lease).
//!
//! Spans are recorded only when the process' `tracing` subscriber has an OpenTelemetry
//! layer (`tracing_opentelemetry::layer()`) that lets the target `outbox::trace` through
//! at level INFO. Without one the relay creates one span per batch to find that out,
//! none per message, and sends every header exactly as stored.
//!
//! The OpenTelemetry parts are behind the cargo feature `otel` (on by default; pure Rust).
//! No OpenTelemetry type is part of this crate's API: the context is read from `tracing`
//! spans and written as plain strings.

use crate::message::OutgoingMessage;
use crate::sink::{Confirmations, PublishError};

#[cfg(feature = "otel")]
use crate::message::{Message, header};
#[cfg(feature = "otel")]
use std::collections::BTreeMap;

/// The `tracing` target of the relay's producer spans (let it through at INFO for them to
/// be recorded).
pub const TARGET: &str = "outbox::trace";

#[cfg(feature = "otel")]
mod otel {
    use super::header;
    use opentelemetry::Context;
    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use std::collections::BTreeMap;

    struct Writer<'a>(&'a mut BTreeMap<String, String>);

    impl Injector for Writer<'_> {
        fn set(&mut self, key: &str, value: String) {
            self.0.insert(key.to_owned(), value);
        }
    }

    struct Reader<'a>(&'a BTreeMap<String, String>);

    impl Extractor for Reader<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            match self.0.get(key) {
                Some(v) => Some(v.as_str()),
                // Header names are case-insensitive on most wires.
                None => self
                    .0
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(key))
                    .map(|(_, v)| v.as_str()),
            }
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }

    fn is_trace_header(name: &str) -> bool {
        name.eq_ignore_ascii_case(header::TRACEPARENT)
            || name.eq_ignore_ascii_case(header::TRACESTATE)
    }

    /// The context stored in `headers` (an empty context when there is none, or it is not
    /// a valid `traceparent`).
    pub(super) fn extract(headers: &BTreeMap<String, String>) -> Context {
        TraceContextPropagator::new().extract_with_context(&Context::new(), &Reader(headers))
    }

    /// Replaces the trace headers of `headers` with `cx`'s span context; returns false
    /// (and changes nothing) when `cx` holds no valid span context.
    pub(super) fn inject(cx: &Context, headers: &mut BTreeMap<String, String>) -> bool {
        if !cx.span().span_context().is_valid() {
            return false;
        }
        headers.retain(|k, _| !is_trace_header(k));
        TraceContextPropagator::new().inject_context(cx, &mut Writer(headers));
        if headers
            .get(header::TRACESTATE)
            .is_some_and(|s| s.is_empty())
        {
            headers.remove(header::TRACESTATE);
        }
        true
    }

    /// The context of the current `tracing` span; the current OpenTelemetry context when
    /// that has no valid span context (no span entered, or no OpenTelemetry layer).
    pub(super) fn current() -> Context {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let cx = tracing::Span::current().context();
        if cx.span().span_context().is_valid() {
            cx
        } else {
            Context::current()
        }
    }
}

#[cfg(feature = "otel")]
impl Message {
    /// Copies the current trace context into this message's `traceparent` and
    /// `tracestate` headers (W3C Trace Context), replacing any already set, so the relay's
    /// publish and the consumers join the trace of the code that enqueues.
    ///
    /// The context is that of the current `tracing` span, read through the
    /// `tracing-opentelemetry` layer (else the current OpenTelemetry context). Without a
    /// valid one (no span entered, no OpenTelemetry layer installed) the message is
    /// returned unchanged. `tracestate` is set only when not empty. Feature `otel`.
    ///
    /// ```
    /// use outbox::Message;
    /// // No span and no OpenTelemetry layer here: nothing is added.
    /// let msg = Message::new("orders.order-placed.v1", b"{}".to_vec()).with_trace_context();
    /// assert!(outbox::trace::current_trace_headers().is_empty());
    /// # let _ = msg;
    /// ```
    #[must_use]
    pub fn with_trace_context(mut self) -> Self {
        otel::inject(&otel::current(), &mut self.headers);
        self
    }
}

/// The current trace context as headers: `traceparent` and, when not empty,
/// `tracestate` (W3C Trace Context), from the current `tracing` span as for
/// [`Message::with_trace_context`]. Empty when there is no valid context. For producers
/// that build the headers themselves, e.g. the JSON headers argument of the SQL entry
/// points. Feature `otel`.
#[cfg(feature = "otel")]
pub fn current_trace_headers() -> BTreeMap<String, String> {
    let mut headers = BTreeMap::new();
    otel::inject(&otel::current(), &mut headers);
    headers
}

/// The relay's producer spans of one batch (slot `i` is `batch[i]`); empty when no
/// OpenTelemetry layer records them.
#[derive(Default)]
pub(crate) struct PublishSpans {
    #[cfg(feature = "otel")]
    spans: Vec<Option<tracing::Span>>,
}

impl PublishSpans {
    /// Opens a producer span per message of `batch` and puts each span's context into its
    /// message's trace headers (see the module docs). `system` names the messaging system
    /// a topic is published to. Does nothing (one disabled or unrecorded span) when no
    /// OpenTelemetry layer records `outbox::trace`.
    #[cfg_attr(not(feature = "otel"), allow(unused_variables))]
    pub(crate) fn start(
        batch: &mut [OutgoingMessage],
        system: impl Fn(&str) -> &'static str,
    ) -> Self {
        #[cfg(feature = "otel")]
        {
            use opentelemetry::trace::TraceContextExt;
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            let mut spans = Vec::new();
            for (i, m) in batch.iter_mut().enumerate() {
                let span = tracing::info_span!(
                    target: TARGET,
                    parent: None,
                    "send",
                    otel.name = %format_args!("send {}", m.topic),
                    otel.kind = "producer",
                    messaging.system = system(&m.topic),
                    messaging.operation.type = "send",
                    messaging.operation.name = "send",
                    messaging.destination.name = %m.topic,
                    messaging.message.id = %m.message_id,
                    messaging.message.body.size = m.payload.len(),
                    outbox.attempt = m.attempts,
                    error.type = tracing::field::Empty,
                );
                // Without an OpenTelemetry layer (or with the span filtered out) setting a
                // parent fails at once: the first message tells for the whole batch,
                // before any header is parsed.
                if i == 0 && span.set_parent(opentelemetry::Context::new()).is_err() {
                    return PublishSpans::default();
                }
                let started = span.set_parent(otel::extract(&m.headers)).is_ok() && {
                    let cx = span.context();
                    cx.span().span_context().is_valid() && otel::inject(&cx, &mut m.headers)
                };
                if !started {
                    if i == 0 {
                        return PublishSpans::default();
                    }
                    spans.push(None);
                    continue;
                }
                spans.push(Some(span));
            }
            PublishSpans { spans }
        }
        #[cfg(not(feature = "otel"))]
        PublishSpans {}
    }

    /// Ends each span as its message's outcome arrives in `confirm` (the batch's slots);
    /// returns once every span has ended. Dropping it early leaves the rest to
    /// [`PublishSpans::finish`].
    #[cfg_attr(not(feature = "otel"), allow(unused_variables))]
    pub(crate) async fn follow(&mut self, confirm: &Confirmations) {
        #[cfg(feature = "otel")]
        loop {
            if self.spans.iter().all(Option::is_none) {
                return;
            }
            let notified = confirm.filled().notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let outcomes = confirm.snapshot();
            for (slot, outcome) in self.spans.iter_mut().zip(&outcomes) {
                if let (Some(_), Some(o)) = (&*slot, outcome)
                    && let Some(span) = slot.take()
                {
                    end(span, Some(o));
                }
            }
            if self.spans.iter().all(Option::is_none) {
                return;
            }
            notified.await;
        }
    }

    /// Ends the spans still open with the batch's final outcomes (`None`: the relay
    /// stopped waiting before the message had one).
    #[cfg_attr(not(feature = "otel"), allow(unused_variables))]
    pub(crate) fn finish(self, outcomes: &[Option<Result<(), PublishError>>]) {
        #[cfg(feature = "otel")]
        for (i, slot) in self.spans.into_iter().enumerate() {
            if let Some(span) = slot {
                end(span, outcomes.get(i).and_then(Option::as_ref));
            }
        }
    }
}

/// Records `outcome` on `span` and ends it.
#[cfg(feature = "otel")]
fn end(span: tracing::Span, outcome: Option<&Result<(), PublishError>>) {
    use opentelemetry::trace::Status;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    match outcome {
        Some(Ok(())) => {}
        Some(Err(e)) => {
            span.record("error.type", e.code.as_str());
            span.set_status(Status::error(e.to_string()));
        }
        None => {
            span.record("error.type", "no_outcome");
            span.set_status(Status::error(
                "no outcome: the relay stopped waiting (shutdown grace or lost lease)",
            ));
        }
    }
}

#[cfg(all(test, feature = "otel"))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use opentelemetry::trace::{SpanKind, Status, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
    use tracing_subscriber::layer::SubscriberExt;

    const T: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const S: &str = "00f067aa0ba902b7";

    /// A subscriber with an OpenTelemetry layer exporting into memory, set for this
    /// thread while the guard lives.
    fn otel() -> (
        InMemorySpanExporter,
        SdkTracerProvider,
        tracing::subscriber::DefaultGuard,
    ) {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let guard = tracing::subscriber::set_default(subscriber);
        (exporter, provider, guard)
    }

    fn attr(span: &SpanData, key: &str) -> Option<String> {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.to_string())
    }

    fn outgoing(id: i64, headers: &[(&str, &str)]) -> OutgoingMessage {
        OutgoingMessage {
            id,
            message_id: uuid::Uuid::now_v7(),
            topic: "orders.placed.v1".into(),
            key: None,
            payload: bytes::Bytes::from_static(b"{}"),
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            occurred_at: chrono::Utc::now(),
            attempts: 1,
        }
    }

    #[tokio::test]
    async fn with_trace_context_copies_the_current_span() {
        let (exporter, _provider, _guard) = otel();
        let msg = {
            let span = tracing::info_span!("place order");
            let _entered = span.enter();
            Message::new("orders.placed.v1", b"{}".to_vec()).with_trace_context()
        };
        let spans = exporter.get_finished_spans().unwrap();
        assert_eq!(spans.len(), 1, "{spans:?}");
        let sc = &spans[0].span_context;
        let want = format!("00-{}-{}-01", sc.trace_id(), sc.span_id());
        assert_eq!(
            msg.headers.get(header::TRACEPARENT),
            Some(&want),
            "{:?}",
            msg.headers
        );
        assert!(!msg.headers.contains_key(header::TRACESTATE));
        // Outside any span: nothing, and an earlier value is kept.
        let plain = Message::new("t", vec![])
            .header(header::TRACEPARENT, "kept")
            .with_trace_context();
        assert_eq!(plain.headers.get(header::TRACEPARENT).unwrap(), "kept");
        assert!(current_trace_headers().is_empty());
    }

    #[tokio::test]
    async fn with_trace_context_without_a_layer_changes_nothing() {
        let _guard = tracing::subscriber::set_default(tracing_subscriber::registry());
        let span = tracing::info_span!("place order");
        let _entered = span.enter();
        let msg = Message::new("t", vec![]).with_trace_context();
        assert!(msg.headers.is_empty());
    }

    #[tokio::test]
    async fn relay_spans_are_children_of_the_stored_context_and_replace_it() {
        let (exporter, _provider, _guard) = otel();
        let parent = format!("00-{T}-{S}-01");
        let mut batch = vec![
            outgoing(
                1,
                &[
                    ("traceparent", &parent),
                    ("tracestate", "vendor=abc"),
                    ("tenant", "acme"),
                ],
            ),
            outgoing(2, &[("Traceparent", &parent)]),
            outgoing(3, &[]),
        ];
        let mut spans = PublishSpans::start(&mut batch, |_| "nats");
        assert!(exporter.get_finished_spans().unwrap().is_empty());
        let confirm = Confirmations::new(3);
        confirm.set(0, Ok(()));
        confirm.set(
            1,
            Err(PublishError::permanent("refused").with_code(crate::error::PublishCode::Nack)),
        );
        // The first two end as their outcomes arrive; the third when the batch finishes.
        tokio::time::timeout(std::time::Duration::from_millis(50), spans.follow(&confirm))
            .await
            .unwrap_err();
        assert_eq!(exporter.get_finished_spans().unwrap().len(), 2);
        spans.finish(&confirm.snapshot());
        let done = exporter.get_finished_spans().unwrap();
        assert_eq!(done.len(), 3);

        for (m, span) in batch.iter().zip(&done) {
            assert_eq!(span.name, "send orders.placed.v1");
            assert_eq!(span.span_kind, SpanKind::Producer);
            assert_eq!(attr(span, "messaging.system").unwrap(), "nats");
            assert_eq!(attr(span, "messaging.operation.type").unwrap(), "send");
            assert_eq!(
                attr(span, "messaging.destination.name").unwrap(),
                "orders.placed.v1"
            );
            assert_eq!(
                attr(span, "messaging.message.id").unwrap(),
                m.message_id.to_string()
            );
            let sc = &span.span_context;
            let sent = format!("00-{}-{}-01", sc.trace_id(), sc.span_id());
            assert_eq!(m.headers.get("traceparent"), Some(&sent), "{:?}", m.headers);
            assert!(!m.headers.contains_key("Traceparent"));
        }
        for span in &done[..2] {
            assert_eq!(span.span_context.trace_id().to_string(), T);
            assert_eq!(span.parent_span_id.to_string(), S);
            assert_ne!(span.span_context.span_id().to_string(), S);
        }
        assert_eq!(done[0].status, Status::Unset);
        assert_eq!(batch[0].headers.get("tracestate").unwrap(), "vendor=abc");
        assert_eq!(batch[0].headers.get("tenant").unwrap(), "acme");
        assert_eq!(attr(&done[1], "error.type").unwrap(), "nack");
        assert!(
            matches!(&done[1].status, Status::Error { description } if description.contains("refused"))
        );
        // No stored context: a new trace.
        assert_ne!(done[2].span_context.trace_id().to_string(), T);
        assert_eq!(
            done[2].parent_span_id,
            opentelemetry::trace::SpanId::INVALID
        );
        assert_eq!(attr(&done[2], "error.type").unwrap(), "no_outcome");
    }

    #[tokio::test]
    async fn an_unsampled_stored_context_stays_unsampled() {
        let (exporter, _provider, _guard) = otel();
        let mut batch = vec![outgoing(1, &[("traceparent", &format!("00-{T}-{S}-00"))])];
        let spans = PublishSpans::start(&mut batch, |_| "nats");
        spans.finish(&[Some(Ok(()))]);
        assert!(exporter.get_finished_spans().unwrap().is_empty());
        let sent = batch[0].headers.get("traceparent").unwrap();
        assert_ne!(sent, &format!("00-{T}-{S}-00"));
        assert!(
            sent.starts_with(&format!("00-{T}-")) && sent.ends_with("-00"),
            "{sent}"
        );
    }

    #[tokio::test]
    async fn relay_spans_without_a_layer_leave_the_headers_alone() {
        let _guard = tracing::subscriber::set_default(tracing_subscriber::registry());
        let parent = format!("00-{T}-{S}-01");
        let mut batch = vec![outgoing(1, &[("traceparent", &parent)]), outgoing(2, &[])];
        let spans = PublishSpans::start(&mut batch, |_| "nats");
        assert!(spans.spans.is_empty());
        assert_eq!(batch[0].headers.get("traceparent"), Some(&parent));
        assert!(batch[1].headers.is_empty());
    }
}
