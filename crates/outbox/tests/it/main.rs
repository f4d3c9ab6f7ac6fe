//! The library's integration tests, in one binary (one link of the library instead of one
//! per file), against real services. A folder per room:
//! - `common`: the shared harness (databases, NATS streams, recording sinks, waits);
//! - `store`: the store contract (`store::conformance`), once per store
//!   (`store::conformance_<store>`), and what each store does beyond it (transactions, the
//!   SQL entry points, TLS to the database, outages, the cleanup horizon, wake-ups);
//! - `sink`: the sink contract (`sink::publisher_conformance`), once per sink in
//!   `sink::conformance` (`sink::conformance::<sink>`; `sink::conformance::cloudevents`:
//!   again with the CloudEvents envelope), each sink's own checks (`sink::sink_<name>`),
//!   classification, control topics, TLS, routing, slow and silent destinations, broker
//!   outages, and `sink::cloudevents`: what the sinks send with `envelope=cloudevents`, read
//!   by the official CloudEvents Python SDK (`sink/cloudevents_sdk.py`);
//! - `relay`: the relay as a whole (decisions over a store, competing relays, crashes,
//!   per-key ordering, idle relays, bad input, hostile sizes, SQLite end to end);
//! - `consumer`: the inbox and the example consumer end to end.
//!
//! Run one room or one module with a filter, e.g. `cargo nextest run -p outbox -E
//! 'test(/^store::conformance_mysql::/)'` or `cargo test -p outbox --test it
//! store::conformance_mysql::`; the Kafka tests (feature `kafka`) are
//! `test(/^sink::(conformance::kafka|sink_kafka)::/)`.

#![allow(clippy::unwrap_used)]
#![allow(clippy::cast_possible_truncation)]

mod common;

mod consumer;
mod relay;
mod sink;
mod store;
