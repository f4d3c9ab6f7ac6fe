//! Run a business transaction (and its enqueues) again when the database asks for it.
//!
//! [`transaction`] begins a transaction on the pool, runs the closure with it, and
//! commits. When the database reports that the transaction lost a conflict — a
//! serialization failure or a deadlock (PostgreSQL `40001`, `40P01`; MySQL/MariaDB error
//! 1213 deadlock, 1205 lock wait timeout; SQLite `SQLITE_BUSY`/`SQLITE_LOCKED`) — the
//! transaction has been rolled back, so it is run again from the start, after a jittered
//! backoff, up to [`RetryPolicy::max_attempts`] times.
//!
//! Re-running is safe for the outbox part: message ids are stable (chosen by the producer
//! or derived from the business data, never at random inside the closure if it may run
//! twice), and enqueue is idempotent on them; and nothing of a rolled-back attempt was
//! written. The closure must not have effects outside the transaction (an HTTP call, a
//! message sent directly), which is the point of an outbox anyway.
//!
//! The closure may run more than once, and its future borrows only the transaction: move
//! clones of what it needs into it (a store is cheap to clone; see the example).
//!
//! A commit whose outcome is unknown (the connection broke while `COMMIT` was in flight)
//! is not retried: it may have committed. It is reported as
//! [`TransactionError::CommitUnknown`] for the caller to reconcile (for example by reading
//! back the business row).

use futures::future::BoxFuture;
use std::time::Duration;

/// How often and how fast [`transaction`] retries.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 5).
    pub max_attempts: u32,
    /// Backoff before the second attempt (default 10 ms); doubles per attempt, with jitter.
    pub base: Duration,
    /// Largest backoff (default 1 s).
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            base: Duration::from_millis(10),
            max: Duration::from_secs(1),
        }
    }
}

/// Why [`transaction`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum TransactionError<E> {
    /// The closure (or begin/commit) failed with an error that a retry cannot fix; the
    /// transaction was rolled back.
    #[error(transparent)]
    Failed(E),
    /// Every attempt lost a conflict (serialization failure, deadlock, busy); the last
    /// error is kept. Nothing was committed.
    #[error("the transaction lost a conflict on each of {attempts} attempts; last error: {last}")]
    Exhausted {
        /// Attempts made.
        attempts: u32,
        /// The last attempt's error.
        last: E,
    },
    /// The connection failed while `COMMIT` was in flight: the transaction may or may not
    /// have committed. Not retried.
    #[error("the commit's outcome is unknown (the connection failed during COMMIT): {0}")]
    CommitUnknown(sqlx::Error),
}

/// Runs `f` in a transaction on `pool` and commits, re-running it on serialization
/// failures, deadlocks and busy errors with the default [`RetryPolicy`]. See the module
/// docs for what is retried and why that is safe.
///
/// ```no_run
/// # async fn f(store: outbox::postgres::PgStore) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox::{Message, transaction::transaction};
/// let order_id = uuid::Uuid::now_v7();
/// transaction(store.pool(), |tx| {
///     let store = store.clone();
///     Box::pin(async move {
///         sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(order_id).execute(&mut **tx).await?;
///         // The message id is derived from the order, so a re-run enqueues the same message.
///         let msg = Message::new("orders.order-placed.v1", b"{}".to_vec()).message_id(order_id);
///         store.enqueue(tx, &msg).await?;
///         Ok::<_, outbox::Error>(())
///     })
/// })
/// .await?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`TransactionError::Failed`] for an error a retry cannot fix,
/// [`TransactionError::Exhausted`] when every attempt lost a conflict,
/// [`TransactionError::CommitUnknown`] when the commit's outcome is unknown.
pub async fn transaction<DB, T, E, F>(pool: &sqlx::Pool<DB>, f: F) -> Result<T, TransactionError<E>>
where
    DB: sqlx::Database,
    F: for<'t> FnMut(&'t mut sqlx::Transaction<'static, DB>) -> BoxFuture<'t, Result<T, E>>,
    E: From<sqlx::Error> + std::error::Error + 'static,
{
    transaction_with(pool, &RetryPolicy::default(), f).await
}

/// [`transaction`] with a [`RetryPolicy`] of your own.
///
/// # Errors
/// As [`transaction`].
pub async fn transaction_with<DB, T, E, F>(
    pool: &sqlx::Pool<DB>,
    policy: &RetryPolicy,
    mut f: F,
) -> Result<T, TransactionError<E>>
where
    DB: sqlx::Database,
    F: for<'t> FnMut(&'t mut sqlx::Transaction<'static, DB>) -> BoxFuture<'t, Result<T, E>>,
    E: From<sqlx::Error> + std::error::Error + 'static,
{
    let max = policy.max_attempts.max(1);
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let err = match pool.begin().await {
            Err(e) => E::from(e),
            Ok(mut tx) => match f(&mut tx).await {
                Err(e) => {
                    // A failed statement may have aborted the transaction already; the
                    // rollback's own error says nothing more.
                    let _ = tx.rollback().await;
                    e
                }
                Ok(value) => match tx.commit().await {
                    Ok(()) => return Ok(value),
                    Err(e) if commit_outcome_unknown(&e) => {
                        return Err(TransactionError::CommitUnknown(e));
                    }
                    Err(e) => E::from(e),
                },
            },
        };
        if !lost_a_conflict(&err) {
            return Err(TransactionError::Failed(err));
        }
        if attempt >= max {
            return Err(TransactionError::Exhausted {
                attempts: attempt,
                last: err,
            });
        }
        let attempt = i32::try_from(attempt).unwrap_or(i32::MAX);
        tokio::time::sleep(crate::backoff::jittered(attempt, policy.base, policy.max)).await;
    }
}

/// A commit error after which the transaction may or may not have committed: the
/// connection failed, so the server's answer never arrived.
fn commit_outcome_unknown(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed
    )
}

/// True when `err` (or an error in its source chain) is a [`sqlx::Error`] saying the
/// transaction lost a conflict and was rolled back: worth running again.
pub fn lost_a_conflict(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(s) = e.downcast_ref::<sqlx::Error>() {
            return is_conflict(s);
        }
        // The library's own error holds the sqlx error as a field, not as its source (so
        // the driver's text is not printed twice in an error chain).
        if let Some(crate::Error::Database(s)) = e.downcast_ref::<crate::Error>() {
            return is_conflict(s);
        }
        cur = e.source();
    }
    false
}

/// Serialization failure, deadlock, lock wait timeout or busy: each store's own codes
/// (`store::classify`).
fn is_conflict(e: &sqlx::Error) -> bool {
    crate::store::classify(e) == crate::store::Failure::Conflict
}
