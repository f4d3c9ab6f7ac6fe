//! The producer's and the consumer's side: enqueueing in the caller's transaction and
//! accepting into the inbox.

use super::MySqlStore;
use crate::error::{Error, Result};
use crate::inbox::Accepted;
use crate::message::{Enqueued, Message};
use crate::store::common::enqueue;
use sqlx::{MySql, Transaction};
use std::time::Duration;

crate::events::enqueue_for!("mysql", MySqlStore, sqlx::MySql);
crate::inbox::inbox_for!("mysql", MySqlStore, sqlx::MySql);

impl MySqlStore {
    /// Accepts the message (an [`Envelope`](crate::Envelope) or its id) for `consumer` inside the consumer's transaction (see
    /// [`crate::inbox`]): inserts the inbox row first, under the primary key
    /// `(consumer, message_id)`, with `INSERT IGNORE`, holding the id's inbox lock (a
    /// `GET_LOCK` user lock, released when the insert returns) so that one accept at a
    /// time waits on the id's row: when the first transaction to accept an id rolls back,
    /// the next one is fresh and the others duplicates, never a deadlock. [`Accepted::Fresh`] means do the
    /// work in this transaction; [`Accepted::Duplicate`] means it was done (or a concurrent
    /// transaction holding the same id committed while this one waited on the key): skip
    /// it. No error on a duplicate, so the transaction stays usable; a rollback removes
    /// the row with the rest. Works at `READ COMMITTED` and at the server's default
    /// `REPEATABLE READ` alike (the duplicate check reads the latest committed row).
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for a consumer name that is empty, over 255 bytes or
    /// holds a control character, before any SQL runs; [`Error::Database`] from the insert
    /// (a lock wait timeout when the concurrent transaction holding the id stays open past
    /// `innodb_lock_wait_timeout`); [`Error::Timeout`] when the id's inbox lock was not
    /// free within `innodb_lock_wait_timeout` (accepts of the id queued behind a
    /// transaction that stays open).
    pub async fn inbox_accept(
        &self,
        tx: &mut Transaction<'_, MySql>,
        consumer: &str,
        message: impl crate::inbox::Incoming,
    ) -> Result<Accepted> {
        let message_id = message.message_id();
        crate::inbox::validate_consumer(consumer)?;
        let id = message_id.hyphenated().to_string();
        let (locked, wait_s): (Option<i64>, i64) =
            sqlx::query_as(self.inner.sql.inbox_lock.clone())
                .bind(consumer.as_bytes())
                .bind(&id)
                .fetch_one(&mut **tx)
                .await?;
        if locked != Some(1) {
            return Err(Error::Timeout(Duration::from_secs(
                u64::try_from(wait_s).unwrap_or(0),
            )));
        }
        let r = sqlx::query(self.inner.sql.inbox_accept.clone())
            .bind(consumer.as_bytes())
            .bind(&id)
            .execute(&mut **tx)
            .await;
        let unlocked = sqlx::query(self.inner.sql.inbox_unlock.clone())
            .bind(consumer.as_bytes())
            .bind(&id)
            .execute(&mut **tx)
            .await;
        let r = r?;
        unlocked?;
        Ok(Accepted::from_rows(r.rows_affected()))
    }

    /// Enqueues `msg` inside the caller's transaction. Idempotent on the message id: a
    /// duplicate returns the existing row's id with `inserted: false`; the duplicate-key
    /// error is the only one absorbed (unlike `INSERT IGNORE`), and InnoDB rolls back only
    /// that statement, so the transaction stays usable.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] / [`Error::MessageTooLarge`] before any SQL runs (the
    /// limit is the smaller of `max_message_bytes` and the server's `max_allowed_packet`
    /// less 64 KiB for the statement around the payload); [`Error::Database`] otherwise.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, MySql>,
        msg: &Message,
    ) -> Result<Enqueued> {
        let limit = self
            .inner
            .config
            .max_message_bytes
            .min(self.inner.max_packet.saturating_sub(64 * 1024));
        msg.validate(limit)?;
        let mid = msg.message_id.hyphenated().to_string();
        let headers = msg.headers_json().to_string();
        let at = msg.available_at.map(|t| t.naive_utc());
        let sql = self.inner.sql.enqueue.clone();
        let inserted = enqueue::insert(sql, msg, mid.clone(), headers, at)
            .execute(&mut **tx)
            .await;
        match inserted {
            Ok(r) => {
                let id = i64::try_from(r.last_insert_id()).unwrap_or(i64::MAX);
                Ok(enqueue::enqueued(msg, id, true))
            }
            // The only unique key an insert can hit is `message_id` (the primary key is
            // AUTO_INCREMENT): a duplicate is the idempotent case.
            Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                let id: i64 = sqlx::query_scalar(self.inner.sql.existing_id.clone())
                    .bind(&mid)
                    .fetch_one(&mut **tx)
                    .await?;
                Ok(enqueue::enqueued(msg, id, false))
            }
            Err(e) => Err(e.into()),
        }
    }
}
