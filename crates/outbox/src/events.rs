//! Domain-event capture: a handler or aggregate pushes its integration events into an
//! [`Events`] collector while it works, and the collector enqueues them all inside the
//! caller's transaction ([`Events::enqueue_all`]).
//!
//! The events stay in the collector until the caller [clears](Events::clear) it after a
//! successful commit, so a transaction that failed, or that
//! [`crate::transaction::transaction`] runs again, enqueues the same events again; their
//! message ids are given at [`Events::push`] (derived from the business data, never drawn
//! at random on each run), so a re-run writes the same rows or finds them already there.
//! A type can be pushed only if it implements [`Contract`] (its versioned topic): an event
//! without a mapping to a topic does not compile, so it can never be dropped silently.

use crate::error::Result;
use crate::message::{Contract, Enqueued, Message};
use async_trait::async_trait;
use uuid::Uuid;

/// A store that can enqueue inside a transaction of its database type: the typed
/// `enqueue` of [`crate::postgres::PgStore`], [`crate::mysql::MySqlStore`] and
/// [`crate::sqlite::SqliteStore`], behind one trait.
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
pub trait Enqueue: Send + Sync {
    /// The `sqlx` database whose transactions this store enqueues in.
    type Database: sqlx::Database;

    /// Enqueues `msg` inside `tx` (idempotent on the message id).
    ///
    /// # Errors
    /// As the store's `enqueue`: invalid or oversized messages before any SQL, database
    /// errors from the insert.
    async fn enqueue_in(
        &self,
        tx: &mut sqlx::Transaction<'_, Self::Database>,
        msg: &Message,
    ) -> Result<Enqueued>;

    /// The store's pool.
    fn pool(&self) -> &sqlx::Pool<Self::Database>;

    /// Enqueues `msg` in a transaction of its own: for tools and scripts (the CLI's
    /// `enqueue`). A service enqueues inside the transaction of its business change
    /// ([`Enqueue::enqueue_in`]), which is the point of an outbox.
    ///
    /// # Errors
    /// As [`Enqueue::enqueue_in`], plus database errors from begin and commit.
    async fn enqueue_alone(&self, msg: &Message) -> Result<Enqueued> {
        let mut tx = self.pool().begin().await?;
        let e = self.enqueue_in(&mut tx, msg).await?;
        tx.commit().await?;
        Ok(e)
    }
}

/// `Enqueue` for one store: its typed `enqueue` and its pool (as `inbox::Inbox` is made).
/// Invoked beside the store (`crate::events::enqueue_for!(feature, Store, Database)`).
macro_rules! enqueue_for {
    ($feature:literal, $store:ty, $db:ty) => {
        #[cfg(feature = $feature)]
        #[::async_trait::async_trait]
        impl $crate::events::Enqueue for $store {
            type Database = $db;
            async fn enqueue_in(
                &self,
                tx: &mut ::sqlx::Transaction<'_, $db>,
                msg: &$crate::message::Message,
            ) -> $crate::error::Result<$crate::message::Enqueued> {
                self.enqueue(tx, msg).await
            }

            fn pool(&self) -> &::sqlx::Pool<$db> {
                <$store>::pool(self)
            }
        }
    };
}
pub(crate) use enqueue_for;

/// Integration events collected during one business operation, as messages.
#[derive(Debug, Clone, Default)]
pub struct Events {
    messages: Vec<Message>,
}

impl Events {
    /// An empty collector.
    pub fn new() -> Self {
        Events::default()
    }

    /// Records `event` as a message on its contract's topic, with message id `id` (stable
    /// across re-runs of the operation: e.g. the event's own id, or
    /// [`crate::inbox::follow_up_id`] of the message being handled).
    ///
    /// # Errors
    /// [`crate::Error::InvalidMessage`] when the event does not serialize to JSON.
    pub fn push<C: Contract>(&mut self, id: Uuid, event: &C) -> Result<()> {
        self.push_with(id, event, |m| m)
    }

    /// [`Events::push`], with `build` setting what else the message carries (a key,
    /// headers, a delay): `events.push_with(id, &e, |m| m.key(order_id))`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidMessage`] when the event does not serialize to JSON.
    pub fn push_with<C: Contract>(
        &mut self,
        id: Uuid,
        event: &C,
        build: impl FnOnce(Message) -> Message,
    ) -> Result<()> {
        let msg = Message::from_contract(event)?;
        // The id is set last: `build` cannot give the event another (random) id by mistake.
        self.messages.push(build(msg).message_id(id));
        Ok(())
    }

    /// The collected messages, in push order.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Number of collected events.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// True when nothing was collected.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Enqueues every collected event inside `tx`, in push order, keeping them in the
    /// collector (call [`Events::clear`] once the transaction committed). Stops at the
    /// first error, which the caller's transaction should then roll back.
    ///
    /// # Errors
    /// The first enqueue error.
    pub async fn enqueue_all<S: Enqueue>(
        &self,
        store: &S,
        tx: &mut sqlx::Transaction<'_, S::Database>,
    ) -> Result<Vec<Enqueued>> {
        let mut out = Vec::with_capacity(self.messages.len());
        for m in &self.messages {
            out.push(store.enqueue_in(tx, m).await?);
        }
        Ok(out)
    }

    /// Forgets the collected events (after the commit succeeded).
    pub fn clear(&mut self) {
        self.messages.clear();
    }
}
