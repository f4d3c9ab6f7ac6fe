//! The consumer inbox: one business effect per delivered message, however often it is
//! delivered.
//!
//! The relay delivers at least once, so a consumer sees some messages twice (a lost
//! confirmation, a redelivery after its broker's ack wait, a replay). The inbox makes the
//! duplicate harmless: inside the transaction of its business change, the consumer first
//! *accepts* the message id under its own name — [`PgStore::inbox_accept`],
//! [`MySqlStore::inbox_accept`], [`SqliteStore::inbox_accept`] — and does the work only
//! when that says [`Accepted::Fresh`]. The row and the business change commit together or
//! not at all: a rolled-back transaction leaves no inbox row, so the message can be
//! processed again.
//!
//! The accept is **insert first** under the unique key `(consumer, message_id)`, never
//! "check, then insert": a concurrent duplicate waits on the unique index until the first
//! transaction ends and then sees [`Accepted::Duplicate`] (PostgreSQL, MySQL), or is
//! serialised behind it by the write lock (SQLite). No exception is raised on a duplicate,
//! so the consumer's transaction stays usable (on PostgreSQL a unique violation would
//! abort it).
//!
//! Tables: `{schema}.inbox` (PostgreSQL), `{prefix}_inbox` (MySQL, SQLite), each
//! `(consumer, message_id, received_at)` with the primary key `(consumer, message_id)`
//! and an index on `received_at`, created by [`Maintenance::migrate`](crate::Maintenance::migrate)
//! (schema version 4). Other languages accept with `SELECT {schema}.inbox_accept(consumer,
//! message_id)` (PostgreSQL, `true` = fresh), `CALL {prefix}_inbox_accept(consumer,
//! message_id)` (MySQL: one row, column `fresh`, 1 or 0), or on SQLite the plain
//! `INSERT INTO {prefix}_inbox (consumer, message_id) VALUES (?, ?) ON CONFLICT DO
//! NOTHING` followed by `changes()` (1 = fresh).
//!
//! Rows are kept until [`Maintenance::inbox_purge`](crate::Maintenance::inbox_purge) deletes them by
//! age; an age under [`MIN_RETENTION`] is refused by the CLI (`outbox inbox purge`).
//!
//! Follow-up messages a consumer enqueues while handling a message get ids from
//! [`follow_up_id`], so re-processing the same incoming message (after a rolled-back
//! attempt, or by a second consumer group in another transaction) enqueues the same ids,
//! and enqueue is idempotent on the message id.
//!

// Each store's accept, or the crate's feature table when that store's feature is off.
#![cfg_attr(
    feature = "postgres",
    doc = "[`PgStore::inbox_accept`]: crate::postgres::PgStore::inbox_accept"
)]
#![cfg_attr(
    not(feature = "postgres"),
    doc = "[`PgStore::inbox_accept`]: crate#features"
)]
#![cfg_attr(
    feature = "mysql",
    doc = "[`MySqlStore::inbox_accept`]: crate::mysql::MySqlStore::inbox_accept"
)]
#![cfg_attr(
    not(feature = "mysql"),
    doc = "[`MySqlStore::inbox_accept`]: crate#features"
)]
#![cfg_attr(
    feature = "sqlite",
    doc = "[`SqliteStore::inbox_accept`]: crate::sqlite::SqliteStore::inbox_accept"
)]
#![cfg_attr(
    not(feature = "sqlite"),
    doc = "[`SqliteStore::inbox_accept`]: crate#features"
)]

use crate::error::{Error, Result};
use async_trait::async_trait;
use std::time::Duration;
use uuid::Uuid;

pub use crate::message::{FOLLOW_UP_NAMESPACE, follow_up_id};

/// A store whose inbox accepts inside a transaction of its database type: the typed
/// `inbox_accept` of [`crate::postgres::PgStore`], [`crate::mysql::MySqlStore`] and
/// [`crate::sqlite::SqliteStore`] behind one trait, for consumer code written once over
/// any of them (with [`crate::events::Enqueue`] for its follow-ups).
///
#[cfg_attr(
    not(feature = "postgres"),
    doc = "[`crate::postgres::PgStore`]: crate#features"
)]
#[cfg_attr(
    not(feature = "mysql"),
    doc = "[`crate::mysql::MySqlStore`]: crate#features"
)]
#[cfg_attr(
    not(feature = "sqlite"),
    doc = "[`crate::sqlite::SqliteStore`]: crate#features"
)]
#[async_trait]
pub trait Inbox: Send + Sync {
    /// The `sqlx` database whose transactions this store accepts in.
    type Database: sqlx::Database;

    /// Accepts `message` for `consumer` inside `tx` (see the module docs: insert first;
    /// [`Accepted::Duplicate`] leaves the transaction usable).
    ///
    /// # Errors
    /// As the store's `inbox_accept`.
    async fn accept_in(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Database>,
        consumer: &str,
        message: &(dyn Incoming + Sync),
    ) -> Result<Accepted>;
}

/// `Inbox` for one store: its typed `inbox_accept` (as `events::Enqueue` is made). Invoked
/// beside the store (`crate::inbox::inbox_for!(feature, Store, Database)`).
macro_rules! inbox_for {
    ($feature:literal, $store:ty, $db:ty) => {
        #[cfg(feature = $feature)]
        #[::async_trait::async_trait]
        impl $crate::inbox::Inbox for $store {
            type Database = $db;
            async fn accept_in(
                &self,
                tx: &mut ::sqlx::Transaction<'_, $db>,
                consumer: &str,
                message: &(dyn $crate::inbox::Incoming + Sync),
            ) -> $crate::error::Result<$crate::inbox::Accepted> {
                self.inbox_accept(tx, consumer, $crate::inbox::Incoming::message_id(message))
                    .await
            }
        }
    };
}
pub(crate) use inbox_for;

/// What an inbox accepts: anything that names the delivered message's id — an
/// [`Envelope`](crate::Envelope) read with one of the [`crate::envelope`] functions, or
/// the bare [`Uuid`] a consumer in another shape found in its message.
pub trait Incoming {
    /// The message id to deduplicate on.
    fn message_id(&self) -> Uuid;
}

impl Incoming for Uuid {
    fn message_id(&self) -> Uuid {
        *self
    }
}

impl Incoming for crate::message::Envelope {
    fn message_id(&self) -> Uuid {
        self.message_id
    }
}

impl Incoming for crate::job::Job {
    fn message_id(&self) -> Uuid {
        self.message_id
    }
}

impl Incoming for crate::message::OutgoingMessage {
    fn message_id(&self) -> Uuid {
        self.message_id
    }
}

impl<T: Incoming + ?Sized> Incoming for &T {
    fn message_id(&self) -> Uuid {
        (**self).message_id()
    }
}

/// What an inbox accept found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Accepted {
    /// First time this consumer sees this message id: do the work in the same transaction.
    Fresh,
    /// The consumer accepted this message id before (committed), or a concurrent
    /// transaction accepted it and committed while this one waited: skip the work, commit
    /// (or roll back) as usual. The transaction is still usable.
    Duplicate,
}

impl Accepted {
    /// True for [`Accepted::Fresh`].
    pub fn is_fresh(self) -> bool {
        self == Accepted::Fresh
    }

    /// From the number of rows the insert wrote (1 fresh, 0 duplicate).
    pub(crate) fn from_rows(rows: u64) -> Self {
        if rows > 0 {
            Accepted::Fresh
        } else {
            Accepted::Duplicate
        }
    }
}

/// The shortest age `outbox inbox purge --older-than` accepts: 1 hour.
///
/// A dedup row must outlive every redelivery of its message: brokers redeliver an
/// unacknowledged message after their ack wait or visibility timeout (NATS JetStream
/// `AckWait` 30 s by default, SQS visibility timeouts up to 12 h, RabbitMQ on channel
/// close, Kafka on a rebalance back to the last committed offset), and the relay itself
/// re-sends after a lost confirmation within its lease. Purging rows younger than the
/// longest such window lets a late duplicate through as fresh. One hour covers the
/// defaults of every sink this library ships with a wide margin; keep rows longer (days)
/// when consumers can be down for longer or a replay of old messages is possible — a
/// replayed message keeps its message id, and the inbox is what keeps its second delivery
/// harmless.
pub const MIN_RETENTION: Duration = Duration::from_secs(3600);

/// Longest consumer name, in bytes.
pub const MAX_CONSUMER_BYTES: usize = 255;

/// Refuses a consumer name that is empty, longer than [`MAX_CONSUMER_BYTES`] or holds a
/// control character, before any SQL runs.
pub(crate) fn validate_consumer(consumer: &str) -> Result<()> {
    if consumer.is_empty() || consumer.len() > MAX_CONSUMER_BYTES {
        return Err(Error::InvalidMessage(format!(
            "inbox consumer must be 1-{MAX_CONSUMER_BYTES} bytes, got {} bytes",
            consumer.len()
        )));
    }
    if consumer.chars().any(char::is_control) {
        return Err(Error::InvalidMessage(format!(
            "inbox consumer {:?} holds a control character",
            consumer.escape_debug().to_string()
        )));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn follow_up_id_is_stable() {
        let incoming = Uuid::parse_str("0190c4a8-0000-7000-8000-000000000001").unwrap();
        let id = follow_up_id(incoming, "billing.invoice-requested.v1");
        // Fixed forever: a change here changes every follow-up id in the field.
        assert_eq!(id.to_string(), STABLE);
        assert_eq!(id.get_version_num(), 5);
        assert_eq!(id, follow_up_id(incoming, "billing.invoice-requested.v1"));
    }

    const STABLE: &str = "5fe4fb67-264f-5929-8470-7cbfc7eea264";

    #[test]
    fn follow_up_id_differs_by_name_and_incoming() {
        let a = Uuid::parse_str("0190c4a8-0000-7000-8000-000000000001").unwrap();
        let b = Uuid::parse_str("0190c4a8-0000-7000-8000-000000000002").unwrap();
        assert_ne!(follow_up_id(a, "x"), follow_up_id(a, "y"));
        assert_ne!(follow_up_id(a, "x"), follow_up_id(b, "x"));
        assert_ne!(follow_up_id(a, ""), follow_up_id(b, ""));
        assert_ne!(follow_up_id(a, "x"), a);
    }

    #[test]
    fn consumer_names_are_checked() {
        assert!(validate_consumer("billing").is_ok());
        assert!(validate_consumer(&"é".repeat(127)).is_ok());
        for bad in ["", "a\u{0}b", "a\nb", "tab\there", "\u{7f}"] {
            assert!(
                matches!(validate_consumer(bad), Err(Error::InvalidMessage(_))),
                "{bad:?}"
            );
        }
        assert!(validate_consumer(&"x".repeat(255)).is_ok());
        assert!(validate_consumer(&"x".repeat(256)).is_err());
        assert!(validate_consumer(&"é".repeat(128)).is_err());
    }

    #[test]
    fn accepted_from_rows() {
        assert_eq!(Accepted::from_rows(1), Accepted::Fresh);
        assert_eq!(Accepted::from_rows(0), Accepted::Duplicate);
        assert!(Accepted::Fresh.is_fresh());
        assert!(!Accepted::Duplicate.is_fresh());
    }
}
