//! What the three stores do alike, written once: the orchestration of an operation, generic
//! over the database, with the statements that differ supplied by each store (a small
//! trait, or the statements and decoded rows passed in).

#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) mod decode;
pub(crate) mod enqueue;
pub(crate) mod ops;
pub(crate) mod registry;
pub(crate) mod replay;
pub(crate) mod retention;
pub(crate) mod schema;
pub(crate) mod views;
