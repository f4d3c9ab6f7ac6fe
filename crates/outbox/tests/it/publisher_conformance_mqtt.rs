//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! mqtt sink and its real server.

#![cfg(feature = "mqtt")]
#![allow(clippy::unwrap_used)]

publisher_conformance_tests!(crate::publisher_conformance::mqtt::MqttHarness);
