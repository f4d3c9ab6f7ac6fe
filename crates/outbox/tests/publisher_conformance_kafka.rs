//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! kafka sink and its real server.

#![cfg(feature = "kafka")]
#![allow(clippy::unwrap_used)]

mod common;
mod publisher_conformance;

publisher_conformance_tests!(publisher_conformance::kafka::KafkaHarness);
