//! # outbox — a transactional outbox for Rust services
//!
//! A service writes "publish this message" as a row in the same database transaction as
//! its business change ([`postgres::PgStore::enqueue`], [`sqlite::SqliteStore::enqueue`],
//! or the `outbox.enqueue(...)` SQL function from any language). A [`Relay`] claims due
//! rows, publishes them to a [`Sink`], waits for each confirmation, and only then marks
//! them dispatched: delivery is **at least once**, and every message carries a stable
//! message id for consumers to deduplicate on.
//!
//! Modules: [`message`] (what producers enqueue), [`store`] (where messages live),
//! [`sink`] (where they go), [`relay`] (the loop between), [`trace`] (trace context in
//! headers, producer spans), [`backoff`], [`redact`] (what of a URL may be shown).

pub mod backoff;
pub mod envelope;
pub mod error;
pub mod events;
pub mod ident;
pub mod inbox;
pub mod message;
pub mod metrics;
pub mod redact;
pub mod relay;
pub mod sink;
pub mod store;
pub mod trace;
pub mod transaction;
#[cfg(feature = "webhook")]
pub mod webhook;

pub use envelope::Envelope;
pub use error::{Error, Result};
pub use ident::Ident;
pub use inbox::{Accepted, follow_up_id};
pub use message::{Contract, Enqueued, Message, OutgoingMessage};
pub use relay::{Relay, RelayConfig, RelayError, RelayHandle, RelayStats};
pub use sink::{PublishError, Sink};
pub use store::{AnyStore, Counts, Store, StoreConfig};

#[cfg(feature = "mysql")]
pub use store::mysql;
#[cfg(feature = "postgres")]
pub use store::postgres;
#[cfg(feature = "sqlite")]
pub use store::sqlite;

/// The README's Rust examples, compiled as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
