//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! nats sink and its real server.

#![cfg(feature = "nats")]
#![allow(clippy::unwrap_used)]

mod common;
mod publisher_conformance;

publisher_conformance_tests!(publisher_conformance::nats::NatsHarness);
