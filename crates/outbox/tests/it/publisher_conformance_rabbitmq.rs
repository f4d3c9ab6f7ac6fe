//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! rabbitmq sink and its real server.

#![cfg(feature = "rabbitmq")]
#![allow(clippy::unwrap_used)]

publisher_conformance_tests!(crate::publisher_conformance::rabbitmq::RabbitMqHarness);
