//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! mqtt sink and its real server.

#![cfg(feature = "mqtt")]
#![allow(clippy::unwrap_used)]

mod common;
mod publisher_conformance;

publisher_conformance_tests!(publisher_conformance::mqtt::MqttHarness);
