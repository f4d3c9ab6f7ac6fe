//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! redis sink and its real server.

#![cfg(feature = "redis")]
#![allow(clippy::unwrap_used)]

mod common;
mod publisher_conformance;

publisher_conformance_tests!(publisher_conformance::redis::RedisHarness);
