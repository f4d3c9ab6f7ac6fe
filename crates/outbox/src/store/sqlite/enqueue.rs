//! Writes in the caller's transaction: `enqueue` and the consumer inbox's `inbox_accept`.

use super::SqliteStore;
use crate::error::Result;
use crate::inbox::Accepted;
use crate::message::{Enqueued, Message};
use crate::store::common::enqueue;
use sqlx::{Row, Sqlite, Transaction};

crate::events::enqueue_for!("sqlite", SqliteStore, sqlx::Sqlite);
crate::inbox::inbox_for!("sqlite", SqliteStore, sqlx::Sqlite);

impl SqliteStore {
    /// Enqueues `msg` inside the caller's transaction; idempotent on the message id (an
    /// existing row comes back with `inserted: false`).
    ///
    /// # Errors
    /// [`Error::InvalidMessage`](crate::Error::InvalidMessage) /
    /// [`Error::MessageTooLarge`](crate::Error::MessageTooLarge) before any SQL runs;
    /// [`Error::Database`](crate::Error::Database) from the insert.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, Sqlite>,
        msg: &Message,
    ) -> Result<Enqueued> {
        msg.validate(self.inner.config.max_message_bytes)?;
        let mid = msg.message_id.hyphenated().to_string();
        let headers = msg.headers_json().to_string();
        let at = msg.available_at.map(|t| t.timestamp_millis());
        let sql = self.inner.sql.enqueue.clone();
        let row = enqueue::insert(sql, msg, mid.clone(), headers, at)
            .fetch_optional(&mut **tx)
            .await?;
        if let Some(row) = row {
            return Ok(enqueue::enqueued(msg, row.try_get(0)?, true));
        }
        let id: i64 = sqlx::query_scalar(self.inner.sql.existing_id.clone())
            .bind(&mid)
            .fetch_one(&mut **tx)
            .await?;
        Ok(enqueue::enqueued(msg, id, false))
    }

    /// Accepts the message (an [`Envelope`](crate::Envelope) or its id) for `consumer` inside the consumer's transaction (see
    /// [`crate::inbox`]): inserts the inbox row first, under the primary key
    /// `(consumer, message_id)`, with `ON CONFLICT DO NOTHING`. [`Accepted::Fresh`] means
    /// do the work in this transaction; [`Accepted::Duplicate`] means it was done: skip it.
    /// SQLite's write lock serialises concurrent accepts (the second waits up to the busy
    /// timeout for the first to commit). No error on a duplicate, so the transaction stays
    /// usable; a rollback removes the row with the rest. A transaction that reads before
    /// it accepts should begin with `BEGIN IMMEDIATE` (`pool.begin_with("BEGIN
    /// IMMEDIATE")`), or its upgrade to a writer can fail with `SQLITE_BUSY` at once.
    ///
    /// Message ids are stored as hyphenated lower-case text (as in `{prefix}_messages`);
    /// other languages accept with `INSERT INTO {prefix}_inbox (consumer, message_id)
    /// VALUES (?, ?) ON CONFLICT DO NOTHING` and read `changes()` (1 = fresh).
    ///
    /// # Errors
    /// [`Error::InvalidMessage`](crate::Error::InvalidMessage) for a consumer name that is
    /// empty, over 255 bytes or holds a control character, before any SQL runs;
    /// [`Error::Database`](crate::Error::Database) from the insert (`SQLITE_BUSY` past the
    /// busy timeout).
    pub async fn inbox_accept(
        &self,
        tx: &mut Transaction<'_, Sqlite>,
        consumer: &str,
        message: impl crate::inbox::Incoming,
    ) -> Result<Accepted> {
        let sql = self.inner.sql.inbox_accept.clone();
        let id = message.message_id().hyphenated().to_string();
        let r = enqueue::accept::<Sqlite, _>(&mut **tx, sql, consumer, id).await?;
        Ok(Accepted::from_rows(r.rows_affected()))
    }
}
