//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! redis sink and its real server.

#![cfg(feature = "redis")]
#![allow(clippy::unwrap_used)]

publisher_conformance_tests!(crate::publisher_conformance::redis::RedisHarness);
