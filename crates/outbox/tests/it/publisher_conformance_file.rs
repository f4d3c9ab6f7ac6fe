//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! file sink (its `local` cases: there is no broker to be down and no topic it refuses).

#![allow(clippy::unwrap_used)]

publisher_conformance_tests!(crate::publisher_conformance::file::FileHarness, local);
