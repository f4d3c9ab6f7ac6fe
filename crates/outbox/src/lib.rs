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
//! Modules: [`message`] (what producers enqueue), [`events`] (integration events kept
//! until the commit), [`transaction`] (retried transactions), [`store`] (where messages
//! live), [`sink`] (where they go), [`relay`] (the loop between), [`envelope`] and
//! [`inbox`] (the consumer's side), [`cloudevents`] (the opt-in CloudEvents 1.0 envelope of
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
//! | `redis` | yes | `sink::redis_streams`, `envelope::from_redis` | — |
//! | `mqtt` | yes | `sink::mqtt`, `envelope::from_mqtt` | — |
//! | `http` | yes | `sink::http` (webhooks; implies `webhook`) | — |
//! | `webhook` | via `http` | `webhook` (Standard Webhooks verify), `envelope::from_webhook` | — |
//! | `otel` | yes | `Message::with_trace_context`, the relay's producer spans | — |
//! | `kafka` | no | `sink::kafka`, `envelope::from_kafka` | builds librdkafka from source (C, about two minutes) |
//!
//! The stdout/file sink, [`envelope::from_json_line`] and the relay are always there.

pub mod backoff;
pub mod cloudevents;
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
pub use relay::{OnDispatch, Relay, RelayConfig, RelayError, RelayHandle, RelayStats};
pub use sink::{PublishError, Sink};
pub use store::{
    AnyStore, Counts, Maintenance, Operations, Registry, Relaying, SettleShortcuts, Store,
    StoreConfig, Views,
};

#[cfg(feature = "mysql")]
pub use store::mysql;
#[cfg(feature = "postgres")]
pub use store::postgres;
#[cfg(feature = "sqlite")]
pub use store::sqlite;

/// The README's Rust examples, compiled as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
