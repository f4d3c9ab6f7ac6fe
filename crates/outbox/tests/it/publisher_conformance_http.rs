//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! http sink and its real server.

#![cfg(feature = "http")]
#![allow(clippy::unwrap_used)]

publisher_conformance_tests!(crate::publisher_conformance::http::HttpHarness);
