//! Writes in the caller's transaction: `enqueue` and the consumer inbox's `inbox_accept`.

use super::{PgStore, schema_sql};
use crate::error::Result;
use crate::inbox::Accepted;
use crate::message::{Enqueued, Message};
use crate::store::common::enqueue;
use sqlx::{AssertSqlSafe, Postgres, Row, Transaction};

impl PgStore {
    /// Enqueues `msg` inside the caller's transaction. Idempotent on the message id: when a
    /// row with that id exists, its id comes back with `inserted: false` and the
    /// transaction stays usable.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`](crate::Error::InvalidMessage) /
    /// [`Error::MessageTooLarge`](crate::Error::MessageTooLarge) before any SQL runs (the
    /// transaction is untouched); [`Error::Database`](crate::Error::Database) from the
    /// insert.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        msg: &Message,
    ) -> Result<Enqueued> {
        msg.validate(self.inner.config.max_message_bytes)?;
        let (headers, at) = (msg.headers_json(), msg.available_at);
        let row = enqueue::insert(
            self.inner.sql.enqueue.clone(),
            msg,
            msg.message_id,
            headers,
            at,
        )
        .fetch_optional(&mut **tx)
        .await?;
        if let Some(row) = row {
            return Ok(enqueue::enqueued(msg, row.try_get(0)?, true));
        }
        let sql = AssertSqlSafe(schema_sql(include_str!("sql/message_id_row.sql"), self.s()));
        let id: i64 = sqlx::query_scalar(sql)
            .bind(msg.message_id)
            .fetch_one(&mut **tx)
            .await?;
        Ok(enqueue::enqueued(msg, id, false))
    }

    /// Accepts the message (an [`Envelope`](crate::Envelope) or its id) for `consumer` inside the consumer's transaction (see
    /// [`crate::inbox`]): inserts the inbox row first, under the primary key
    /// `(consumer, message_id)`, with `ON CONFLICT DO NOTHING`. [`Accepted::Fresh`] means
    /// do the work in this transaction; [`Accepted::Duplicate`] means it was done (or a
    /// concurrent transaction holding the same id committed while this one waited): skip
    /// it. A duplicate raises no error, so the transaction stays usable either way; a
    /// rollback removes the row with the rest. Run the transaction at `READ COMMITTED`
    /// (PostgreSQL's default): at `REPEATABLE READ` a duplicate committed after the
    /// snapshot fails with a serialization error (SQLSTATE 40001) to be retried.
    ///
    /// ```no_run
    /// # async fn f(store: outbox::postgres::PgStore, incoming: outbox::Envelope) -> Result<(), outbox::Error> {
    /// use outbox::inbox::Accepted;
    /// let mut tx = store.pool().begin().await?;
    /// if store.inbox_accept(&mut tx, "billing", &incoming).await? == Accepted::Fresh {
    ///     // ... the business change on &mut *tx ...
    /// }
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidMessage`](crate::Error::InvalidMessage) for a consumer name that is
    /// empty, over 255 bytes or holds a control character, before any SQL runs;
    /// [`Error::Database`](crate::Error::Database) from the insert.
    pub async fn inbox_accept(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        consumer: &str,
        message: impl crate::inbox::Incoming,
    ) -> Result<Accepted> {
        let sql = self.inner.sql.inbox_accept.clone();
        let r =
            enqueue::accept::<Postgres, _>(&mut **tx, sql, consumer, message.message_id()).await?;
        Ok(Accepted::from_rows(r.rows_affected()))
    }
}

crate::events::enqueue_for!("postgres", PgStore, sqlx::Postgres);
crate::inbox::inbox_for!("postgres", PgStore, sqlx::Postgres);
