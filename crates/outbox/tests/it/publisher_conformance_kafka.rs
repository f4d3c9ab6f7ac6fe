//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! kafka sink and its real server.

#![cfg(feature = "kafka")]
#![allow(clippy::unwrap_used)]

publisher_conformance_tests!(crate::publisher_conformance::kafka::KafkaHarness);
