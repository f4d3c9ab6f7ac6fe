//! `relay --otlp-endpoint URL`: the relay's producer spans exported over OTLP/HTTP
//! (protobuf), through a batch span processor, as service `outbox-relay`.

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::time::Duration;
use tracing_subscriber::Layer;

/// The `service.name` of the exported spans.
const SERVICE_NAME: &str = "outbox-relay";

/// The OTLP/HTTP traces path, appended to a base URL.
const TRACES_PATH: &str = "/v1/traces";

/// How long the exit may wait for the last spans to go out.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Where spans are posted: `URL/v1/traces` for a base URL (`http://collector:4318`), or
/// the URL itself when it already ends in `/v1/traces`.
fn traces_url(endpoint: &str) -> anyhow::Result<String> {
    let url = url::Url::parse(endpoint).with_context(|| {
        format!(
            "--otlp-endpoint {:?} is not a URL (expected http://HOST:PORT, e.g. http://127.0.0.1:4318)",
            outbox::redact::redact_url(endpoint)
        )
    })?;
    anyhow::ensure!(
        matches!(url.scheme(), "http" | "https"),
        "--otlp-endpoint {:?} must be an http:// or https:// URL (OTLP over HTTP with protobuf)",
        outbox::redact::redact_url(endpoint)
    );
    let trimmed = endpoint.trim_end_matches('/');
    Ok(if trimmed.ends_with(TRACES_PATH) {
        trimmed.to_owned()
    } else {
        format!("{trimmed}{TRACES_PATH}")
    })
}

/// The tracer provider exporting to `endpoint` (see [`traces_url`]). Build it outside the
/// async runtime: the exporter's HTTP client is a blocking one, used from the batch
/// processor's own thread.
pub(crate) fn provider(endpoint: &str) -> anyhow::Result<SdkTracerProvider> {
    let url = traces_url(endpoint)?;
    // The workspace's one rustls provider, for https endpoints (reqwest takes the default).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .build()
        .with_context(|| {
            format!(
                "cannot set up the OTLP exporter for {:?}",
                outbox::redact::redact_url(endpoint)
            )
        })?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(SERVICE_NAME).build())
        .build())
}

/// The `tracing` layer feeding `provider`: the relay's producer spans (target
/// `outbox::trace`), whatever `OUTBOX_LOG` says, and nothing else (the exporter's own
/// HTTP client must not trace itself).
pub(crate) fn layer<S>(provider: &SdkTracerProvider) -> impl Layer<S> + use<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(SERVICE_NAME))
        .with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_target(outbox::trace::TARGET, tracing::Level::INFO),
        )
}

/// Sends the spans still buffered and stops the exporter (bounded by
/// [`SHUTDOWN_TIMEOUT`]).
pub(crate) fn shutdown(provider: &SdkTracerProvider) {
    if let Err(e) = provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
        eprintln!("warning: exporting the last spans failed: {e}");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_traces_path_is_added_once() {
        for (given, want) in [
            ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
            ("http://127.0.0.1:4318/", "http://127.0.0.1:4318/v1/traces"),
            ("https://c.example/otlp", "https://c.example/otlp/v1/traces"),
            ("http://c:4318/v1/traces", "http://c:4318/v1/traces"),
        ] {
            assert_eq!(traces_url(given).unwrap(), want);
        }
        assert!(traces_url("grpc://c:4317").is_err());
        assert!(traces_url("127.0.0.1:4318").is_err());
    }
}
