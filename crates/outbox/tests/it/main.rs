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
mod store;
#[macro_use]
mod publisher_conformance;

mod bad_input;
mod broker_outage;
mod cloudevents;
mod concurrent_relays;
mod confirm_crash;
mod consumer_e2e;
mod control_topics;
mod hostile_sizes;
mod idle_relay;
mod inbox;
mod ordering;
mod publisher_conformance_cloudevents;
mod publisher_conformance_file;
mod publisher_conformance_http;
mod publisher_conformance_kafka;
mod publisher_conformance_mqtt;
mod publisher_conformance_nats;
mod publisher_conformance_rabbitmq;
mod publisher_conformance_redis;
mod publisher_conformance_router;
mod rabbitmq_outage;
mod relay_suite;
mod routing;
mod sink_classification;
mod sink_http;
mod sink_kafka;
mod sink_mqtt;
mod sink_rabbitmq;
mod sink_redis;
mod slow_destinations;
mod sqlite_e2e;
mod timeout_after_send;
mod tls;
