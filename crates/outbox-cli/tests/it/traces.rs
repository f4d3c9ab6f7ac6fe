//! `outbox relay --otlp-endpoint`: the relay's producer spans reach an OTLP/HTTP receiver
//! (protobuf) as children of each message's stored `traceparent`, and the messages go out
//! carrying the relay span's context; without the flag nothing changes. SQLite and the
//! file sink only, with the receiver inside the test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{Span, span::SpanKind, status::StatusCode as Code};
use prost::Message as _;
use std::process::Command;
use std::sync::{Arc, Mutex};

/// The producer's trace id and span id (the `traceparent` enqueued).
const T: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const S: &str = "00f067aa0ba902b7";
const TOPIC: &str = "orders.order-placed.v1";

fn outbox() -> Command {
    let mut c = crate::common::outbox();
    c.env_remove("OUTBOX_OTLP_ENDPOINT");
    // The exporter reads the standard OpenTelemetry variables; none may change this run.
    for (k, _) in std::env::vars() {
        if k.starts_with("OTEL_") {
            c.env_remove(k);
        }
    }
    c
}

/// Runs `outbox ARGS` off the async runtime; its stdout, or a panic with its output.
async fn run_ok(args: Vec<String>) -> String {
    tokio::task::spawn_blocking(move || {
        let out = outbox().args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "outbox {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    })
    .await
    .unwrap()
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// What the receiver got: each request's content type and decoded body.
type Received = Arc<Mutex<Vec<(String, ExportTraceServiceRequest)>>>;

async fn export(
    State(got): State<Received>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], Vec<u8>) {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let proto = [(header::CONTENT_TYPE, "application/x-protobuf")];
    match ExportTraceServiceRequest::decode(body) {
        Ok(request) => {
            got.lock().unwrap().push((content_type, request));
            (
                StatusCode::OK,
                proto,
                ExportTraceServiceResponse::default().encode_to_vec(),
            )
        }
        Err(_) => (StatusCode::BAD_REQUEST, proto, Vec::new()),
    }
}

/// A minimal OTLP/HTTP receiver on a free loopback port: `POST /v1/traces`, protobuf.
async fn receiver() -> (String, Received) {
    let got: Received = Arc::default();
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(export))
        .with_state(got.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), got)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a str> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .and_then(|v| match v {
            any_value::Value::StringValue(s) => Some(s.as_str()),
            _ => None,
        })
}

/// Every span received, with its resource's `service.name`.
fn spans(got: &Received) -> Vec<(String, Span)> {
    let mut out = Vec::new();
    for (_, request) in got.lock().unwrap().iter() {
        for rs in &request.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| attr(&r.attributes, "service.name"))
                .unwrap_or_default()
                .to_owned();
            for ss in &rs.scope_spans {
                for span in &ss.spans {
                    out.push((service.clone(), span.clone()));
                }
            }
        }
    }
    out
}

/// The JSON lines the file sink wrote.
fn lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn message_id(enqueued: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(enqueued.trim()).unwrap();
    v["message_id"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_spans_continue_the_stored_trace_and_go_on_the_wire() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let (endpoint, got) = receiver().await;
    run_ok(args(&["--database-url", &db, "migrate"])).await;
    let traceparent = format!("00-{T}-{S}-01");
    let enqueue = |extra: &[&str]| {
        let mut a = args(&[
            "--database-url",
            &db,
            "enqueue",
            "--topic",
            TOPIC,
            "--payload",
            r#"{"order":42}"#,
        ]);
        a.extend(args(extra));
        run_ok(a)
    };
    let traced = message_id(
        &enqueue(&[
            "--header",
            &format!("traceparent={traceparent}"),
            "--header",
            "tracestate=vendor=abc",
        ])
        .await,
    );
    let untraced = message_id(&enqueue(&[]).await);

    let file = dir.path().join("out.jsonl");
    run_ok(args(&[
        "--database-url",
        &db,
        "relay",
        "--drain",
        "--sink",
        &format!("file:{}", file.display()),
        "--otlp-endpoint",
        &endpoint,
    ]))
    .await;

    // The exporter posted protobuf, and the relay exited only after the last batch of
    // spans was answered.
    {
        let requests = got.lock().unwrap();
        assert!(!requests.is_empty(), "the receiver got no export request");
        for (content_type, _) in requests.iter() {
            assert_eq!(content_type, "application/x-protobuf");
        }
    }
    let received = spans(&got);
    assert_eq!(received.len(), 2, "one span per message: {received:#?}");
    let by_id = |id: &str| {
        received
            .iter()
            .find(|(_, s)| attr(&s.attributes, "messaging.message.id") == Some(id))
            .unwrap_or_else(|| panic!("no span for message {id}: {received:#?}"))
    };
    for id in [&traced, &untraced] {
        let (service, span) = by_id(id);
        assert_eq!(service, "outbox-relay");
        assert_eq!(span.name, format!("send {TOPIC}"));
        assert_eq!(span.kind, SpanKind::Producer as i32);
        assert_eq!(attr(&span.attributes, "messaging.system"), Some("file"));
        assert_eq!(
            attr(&span.attributes, "messaging.destination.name"),
            Some(TOPIC)
        );
        assert_eq!(
            attr(&span.attributes, "messaging.operation.type"),
            Some("send")
        );
        assert_eq!(
            span.status.as_ref().map_or(0, |s| s.code),
            Code::Unset as i32,
            "a confirmed publish is no error: {span:?}"
        );
        assert!(span.end_time_unix_nano >= span.start_time_unix_nano);
    }

    // The traced message: a child of the producer's span, in the producer's trace.
    let (_, span) = by_id(&traced);
    assert_eq!(hex(&span.trace_id), T);
    assert_eq!(hex(&span.parent_span_id), S);
    let relay_span = hex(&span.span_id);
    assert_ne!(relay_span, S);
    // The untraced one starts a trace of its own.
    let (_, root) = by_id(&untraced);
    assert!(root.parent_span_id.is_empty(), "{root:?}");
    assert_ne!(hex(&root.trace_id), T);

    // On the wire: the relay span's context, not the producer's.
    let written = lines(&file);
    assert_eq!(written.len(), 2);
    let line = |id: &str| {
        written
            .iter()
            .find(|l| l["message_id"] == id)
            .unwrap_or_else(|| panic!("message {id} not written: {written:#?}"))
    };
    let headers = &line(&traced)["headers"];
    assert_eq!(headers["traceparent"], format!("00-{T}-{relay_span}-01"));
    assert_eq!(headers["tracestate"], "vendor=abc");
    assert_eq!(
        line(&untraced)["headers"]["traceparent"],
        format!("00-{}-{}-01", hex(&root.trace_id), hex(&root.span_id))
    );

    // Without --otlp-endpoint: no span, and the stored headers go out as they are.
    let again = message_id(&enqueue(&["--header", &format!("traceparent={traceparent}")]).await);
    let plain = dir.path().join("plain.jsonl");
    run_ok(args(&[
        "--database-url",
        &db,
        "relay",
        "--drain",
        "--sink",
        &format!("file:{}", plain.display()),
    ]))
    .await;
    let written = lines(&plain);
    assert_eq!(written.len(), 1);
    assert_eq!(written[0]["message_id"], again.as_str());
    assert_eq!(written[0]["headers"]["traceparent"], traceparent.as_str());
    assert_eq!(spans(&got).len(), 2, "no span without --otlp-endpoint");
}
