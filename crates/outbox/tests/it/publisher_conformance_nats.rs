//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! nats sink and its real server.

#![cfg(feature = "nats")]
#![allow(clippy::unwrap_used)]

publisher_conformance_tests!(crate::publisher_conformance::nats::NatsHarness);
