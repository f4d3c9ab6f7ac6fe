//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! `Router` as a sink: two routes to two file sinks (a route to a stopped NATS server for
//! the broker-down case; a topic no route matches for the permanent one).

#![cfg(feature = "nats")]
#![allow(clippy::unwrap_used)]

publisher_conformance_tests!(crate::publisher_conformance::router::RouterHarness);
