//! # outbox — a transactional outbox for Rust services
//!
//! A service writes "publish this message" as a row in the same database transaction as
//! its business change ([`postgres::PgStore::enqueue`], [`mysql::MySqlStore::enqueue`],
//! [`sqlite::SqliteStore::enqueue`], or the `outbox.enqueue(...)` SQL function /
//! `CALL outbox_enqueue(...)` procedure from any language). A [`Relay`] claims due rows,
//! publishes them to a [`Sink`], waits for each confirmation, and only then marks them
//! dispatched: delivery is **at least once**, and every message carries a stable message
//! id for consumers to deduplicate on — with the [`inbox`], after reading what arrived
//! with [`envelope`].
//!
//! ## Example
//!
//! An order and its `orders.order-placed.v1` message committed together, and a relay in
//! the same process that publishes it to NATS JetStream until the service stops. It needs
//! the features `postgres` and `nats` (both default), and in the service's own
//! `Cargo.toml` `sqlx` (0.9, `runtime-tokio` and `postgres`), `tokio` (`rt-multi-thread`,
//! `macros`, `signal`) and `serde` (`derive`):
//!
//! ```no_run
//! use std::sync::Arc;
//! use outbox::store::prelude::*; // the store traits: migrate, …
//! use outbox::{Contract, Message, Relay, RelayConfig, StoreConfig, postgres::PgStore, sink};
//!
//! #[derive(serde::Serialize)]
//! struct OrderPlacedV1 {
//!     order_id: i64,
//! }
//! impl Contract for OrderPlacedV1 {
//!     const TOPIC: &'static str = "orders.order-placed.v1";
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let store = PgStore::connect("postgres://localhost/app", StoreConfig::default()).await?;
//!     store.migrate().await?; // creates or upgrades the outbox schema; idempotent
//!
//!     // The business change and its message: both commit, or neither does.
//!     let mut tx = store.pool().begin().await?;
//!     sqlx::query("INSERT INTO orders (id) VALUES ($1)")
//!         .bind(42_i64)
//!         .execute(&mut *tx)
//!         .await?;
//!     let placed = Message::from_contract(&OrderPlacedV1 { order_id: 42 })?.key("order-42");
//!     store.enqueue(&mut tx, &placed).await?;
//!     tx.commit().await?;
//!
//!     // The relay: claims due rows, publishes them, marks each one the broker confirmed.
//!     let sink = sink::open("nats://127.0.0.1:4222").await?;
//!     let relay = Relay::new(Arc::new(store), Arc::from(sink), RelayConfig::default()).spawn();
//!     tokio::signal::ctrl_c().await?;
//!     // Stop claiming, let the publishes in flight finish within the grace, release the rest.
//!     let stats = relay.shutdown().await?;
//!     println!("{} dispatched", stats.dispatched);
//!     Ok(())
//! }
//! ```
//!
//! The relay also runs as a program of its own (`outbox relay`, the `outbox-cli` crate),
//! for producers in any language. The user guide (`docs/guide` in the repository) covers
//! transactions that are re-run, domain events, consumers and the inbox.
//!
//! ## Invariants
//!
//! Imports between the top-level modules point down the floors below: no module imports
//! one that imports it back (unit tests may reach anywhere).
//!
//! - **Vocabulary, the bottom floor:** [`status`] (row states), [`topic`] (topic
//!   patterns), [`message`] (what is enqueued, published and read back; follow-up ids)
//!   and [`error`] ([`Error`]; [`PublishError`] with its [`error::ErrorKind`] and
//!   [`error::PublishCode`]). They do no IO. `status` imports nothing of the crate,
//!   `message` only `error`, `topic` only `message`. Each database's error codes are read in
//!   `error` itself (`error::codes`), so [`Error::is_transient`] asks no store.
//! - **Formats:** [`cloudevents`] imports only the vocabulary; [`envelope`] reads each
//!   sink's wire form through `cloudevents`, never the reverse.
//! - **Sinks never import stores**, nor the relay: [`sink`] stands on the vocabulary,
//!   the formats ([`cloudevents`], [`envelope`], [`webhook`]), [`metrics`] and
//!   [`redact`].
//! - **[`metrics`] imports no store type:** it takes plain values; the conversion from
//!   the store's samples sits above both.
//! - **Only the CLI reads the config file** (`outbox.toml`).
//! - **[`events`] and [`inbox`] name no store:** each store implements their traits in
//!   its own folder (`store/<db>/enqueue.rs`).
//! - **[`job`] is a sink:** a job [`job::Handler`] implements [`Sink`]; `job` stands on
//!   [`sink`] and the vocabulary, and no sink imports it back.
//! - **[`relay`] knows no SQL and no broker:** it talks to the store's role traits and to
//!   [`Sink`] only.
//!
//! Modules: [`message`] (what producers enqueue, what consumers read), [`status`] and
//! [`topic`] (row states, topic patterns), [`error`], [`events`] (integration events kept
//! until the commit), [`transaction`] (retried transactions), [`store`] (where messages
//! live), [`sink`] (where they go), [`relay`] (the loop between), [`envelope`] and
//! [`inbox`] (the consumer's side), [`job`] (handlers: the relay runs your code as a
//! destination), [`cloudevents`] (the opt-in CloudEvents 1.0 envelope of
//! the sinks that have a protocol binding), [`trace`] (trace context in headers, producer spans),
//! [`metrics`], [`backoff`], [`redact`] (what of a URL may be shown).
//!
//! ## Features
//!
//! | feature | default | what it adds | needs |
//! | --- | --- | --- | --- |
//! | `postgres` | yes | [`postgres::PgStore`] | — |
//! | `mysql` | yes | [`mysql::MySqlStore`] (MySQL 8.0.13+, MariaDB 10.6+) | — |
//! | `sqlite` | yes | [`sqlite::SqliteStore`] (bundled SQLite) | a C compiler (SQLite is compiled in) |
//! | `nats` | yes | `sink::nats`, `envelope::from_nats` | — |
//! | `rabbitmq` | yes | `sink::rabbitmq`, `envelope::from_amqp` | — |
//! | `redis` | yes | `sink::redis_streams`, `sink::sidekiq`, `envelope::from_redis` | — |
//! | `mqtt` | yes | `sink::mqtt`, `envelope::from_mqtt` | — |
//! | `http` | yes | `sink::http` (webhooks; implies `webhook`) | — |
//! | `tls` | via each network sink | [`sink::tls`] (`ca=`, `cert=`, `key=`, `password_file=`) | — |
//! | `webhook` | via `http` | `webhook` (Standard Webhooks verify), `envelope::from_webhook` | — |
//! | `otel` | yes | `Message::with_trace_context`, the relay's producer spans | — |
//! | `kafka` | no | `sink::kafka`, `envelope::from_kafka` | builds librdkafka from source (C, about two minutes) |
//!
//! The stdout/file sink, [`envelope::from_json_line`] and the relay are always there.
//!

// A link to an item whose feature is off in this build leads to the table above instead.
#![cfg_attr(
    not(feature = "postgres"),
    doc = "[`postgres::PgStore::enqueue`]: crate#features"
)]
#![cfg_attr(
    not(feature = "postgres"),
    doc = "[`postgres::PgStore`]: crate#features"
)]
#![cfg_attr(
    not(feature = "mysql"),
    doc = "[`mysql::MySqlStore::enqueue`]: crate#features"
)]
#![cfg_attr(not(feature = "mysql"), doc = "[`mysql::MySqlStore`]: crate#features")]
#![cfg_attr(
    not(feature = "sqlite"),
    doc = "[`sqlite::SqliteStore::enqueue`]: crate#features"
)]
#![cfg_attr(
    not(feature = "sqlite"),
    doc = "[`sqlite::SqliteStore`]: crate#features"
)]
#![cfg_attr(not(feature = "webhook"), doc = "[`webhook`]: crate#features")]
#![cfg_attr(not(feature = "tls"), doc = "[`sink::tls`]: crate#features")]

pub mod backoff;
pub mod cloudevents;
#[cfg(any(feature = "tls", feature = "postgres", feature = "mysql"))]
mod crypto;
pub mod envelope;
pub mod error;
pub mod events;
pub mod ident;
pub mod inbox;
pub mod job;
pub mod message;
pub mod metrics;
pub mod redact;
pub mod relay;
pub mod sink;
pub mod status;
pub mod store;
mod store_gauges;
pub mod topic;
pub mod trace;
pub mod transaction;
pub mod verdict;
#[cfg(feature = "webhook")]
pub mod webhook;

pub use envelope::Envelope;
pub use error::{Error, Result};
pub use ident::Ident;
pub use inbox::{Accepted, follow_up_id};
pub use message::{Contract, Enqueued, Message, OutgoingMessage};
pub use relay::{OnDispatch, Relay, RelayConfig, RelayError, RelayHandle, RelayStats};
pub use sink::{PublishError, Sink};
pub use status::Status;
pub use store::{
    AnyStore, Counts, Maintenance, Operations, Registry, Relaying, SettleShortcuts, Store,
    StoreConfig, Views,
};
/// The token that stops a relay ([`Relay::run`]), re-exported so that a service needs no
/// direct dependency on `tokio-util` for it.
pub use tokio_util::sync::CancellationToken;

#[cfg(feature = "mysql")]
pub use store::mysql;
#[cfg(feature = "postgres")]
pub use store::postgres;
#[cfg(feature = "sqlite")]
pub use store::sqlite;

#[cfg(test)]
mod tests {
    /// The store's row codes are the [`crate::Status`] values.
    #[test]
    fn store_status_codes_are_the_status_values() {
        use crate::status::{self, Status};
        use crate::store::status as stored;
        for (code, s) in [
            (stored::PENDING, Status::Pending),
            (stored::CLAIMED, Status::Claimed),
            (stored::DISPATCHED, Status::Dispatched),
            (stored::DEAD, Status::Dead),
        ] {
            assert_eq!(code, s.as_i16(), "{s}");
        }
        assert_eq!(
            [
                status::PENDING,
                status::CLAIMED,
                status::DISPATCHED,
                status::DEAD
            ],
            [
                stored::PENDING,
                stored::CLAIMED,
                stored::DISPATCHED,
                stored::DEAD
            ]
        );
    }
}

/// The README's Rust examples, compiled as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The user guide's Rust examples (`docs/guide/src/`), compiled as doc tests the same way:
/// one struct per page that holds a Rust code block.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/guide/src/library.md")]
struct GuideLibraryDoctests;

#[cfg(doctest)]
#[doc = include_str!("../../../docs/guide/src/consuming.md")]
struct GuideConsumingDoctests;

#[cfg(doctest)]
#[doc = include_str!("../../../docs/guide/src/traces.md")]
struct GuideTracesDoctests;

#[cfg(doctest)]
#[doc = include_str!("../../../docs/guide/src/jobs.md")]
struct GuideJobsDoctests;
