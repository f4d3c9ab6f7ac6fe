//! The library's integration tests, in one binary (one link of the library instead of one
//! per file). Modules:
//! - `common`: the shared harness (databases, NATS streams, recording sinks, waits);
//! - `conformance` + `conformance_<store>`: the store contract, once per store;
//! - `publisher_conformance` + `publisher_conformance_<sink>`: the sink contract, once per
//!   sink against its real broker (`publisher_conformance_cloudevents`: again with the
//!   CloudEvents envelope);
//! - `cloudevents`: what the sinks send with `envelope=cloudevents`, read by the official
//!   CloudEvents Python SDK (`cloudevents_sdk.py`);
//! - the rest: relay, router, sink and consumer behaviour against real services.
//!
//! Run one area with a filter, e.g. `cargo nextest run -p outbox -E 'test(/^conformance_mysql::/)'`
//! or `cargo test -p outbox --test it conformance_mysql::`.

#![allow(clippy::unwrap_used)]

mod common;

mod consumer;
mod relay;
mod sink;
mod store;
