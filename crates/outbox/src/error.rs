//! Errors of the store layer and of enqueue, and of a publish.
//!
//! One error type per layer: [`Error`] for everything that touches the store
//! (enqueue, claim, mark, migrate, status), [`PublishError`] for a sink (also at
//! `sink::PublishError`), with its [`ErrorKind`] and reason code [`PublishCode`].

use std::time::Duration;

mod publish;

pub use publish::{
    CONTROL_TOPIC, ErrorKind, IN_FLIGHT, PublishCode, PublishError, TIMED_OUT_AFTER_SEND,
};

/// An error from the outbox library (enqueue, the store, the relay's store calls).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The message was refused before anything was written: the producer's transaction is
    /// untouched and may go on or roll back.
    #[error("invalid message: {0}")]
    InvalidMessage(String),

    /// Key + headers + payload exceed the store's configured limit.
    #[error(
        "message too large: {size} bytes (payload, topic, key and headers) exceed the limit of {limit} bytes; raise the limit (--max-message-bytes, StoreConfig::max_message_bytes) or split the message"
    )]
    MessageTooLarge {
        /// Size of payload + topic + key + header names and values, in bytes.
        size: usize,
        /// The configured limit, in bytes.
        limit: usize,
    },

    /// A schema or table name that is not a plain SQL identifier.
    #[error(
        "invalid identifier {0:?}: use 1-63 characters of a-z, 0-9 and _, starting with a letter or _"
    )]
    InvalidIdentifier(String),

    /// The database URL names a store this build does not know.
    #[error(
        "unsupported database URL {0:?}: expected postgres://…, mysql://…, mariadb://… or sqlite://PATH"
    )]
    UnsupportedDatabaseUrl(String),

    /// The outbox tables are missing or older than this build.
    #[error(
        "the outbox schema {schema:?} is not migrated (found version {found}, need {expected}): run `outbox migrate` (with the same --database-url and --schema) first"
    )]
    NotMigrated {
        /// Schema (PostgreSQL) or table prefix (SQLite).
        schema: String,
        /// The version found in the store (0 when the tables are absent).
        found: i64,
        /// The version this build needs.
        expected: i64,
    },

    /// A row read from the store does not have the expected shape (for example headers
    /// that are not a JSON object of strings).
    #[error("malformed row {id} in the outbox: {reason}")]
    MalformedRow {
        /// Primary key of the row.
        id: i64,
        /// What is wrong with it.
        reason: String,
    },

    /// An operator request that cannot be carried out as given (an empty selector, reason
    /// or name; a bad topic pattern). Nothing was changed.
    #[error("{0}")]
    InvalidRequest(String),

    /// The database failed or could not be reached. Shown as the server's message and its
    /// code (`SQLSTATE` on PostgreSQL, the error number on MySQL), without the driver's
    /// wrapping or PostgreSQL's source-line position.
    ///
    /// The sqlx error is this variant's field, not its `source()`: an error chain printed
    /// with its causes (`anyhow`'s `{:#}`) shows the message once.
    #[error("database error: {}", DbDisplay(.0))]
    Database(sqlx::Error),

    /// A store operation did not finish in time.
    #[error("store operation timed out after {0:?}")]
    Timeout(Duration),
}

impl Error {
    /// True when retrying the same call later can succeed (connection loss, timeouts,
    /// serialization failures, lock timeouts, a busy SQLite database).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Timeout(_) => true,
            Error::Database(e) => crate::store::classify(e) != crate::store::Failure::Other,
            _ => false,
        }
    }
}

/// A database error as a user reads it: the server's message and code, not "error returned
/// from database: … at line 948" (sqlx appends the line of PostgreSQL's own C source).
struct DbDisplay<'a>(&'a sqlx::Error);

impl std::fmt::Display for DbDisplay<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            sqlx::Error::Database(db) => {
                write!(f, "{}", db.message())?;
                #[cfg(feature = "mysql")]
                if let Some(n) = crate::store::mysql::error_number(self.0) {
                    return write!(f, " (MySQL error {n})");
                }
                match db.code() {
                    Some(code) => write!(f, " (code {code})"),
                    None => Ok(()),
                }
            }
            other => {
                // sqlx reports a failed handshake (an untrusted or misnamed certificate)
                // as "error communicating with database": say it is TLS.
                #[cfg(any(feature = "postgres", feature = "mysql"))]
                if let sqlx::Error::Io(io) = other
                    && let Some(tls) = io.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>())
                {
                    return write!(f, "TLS: {tls}");
                }
                write!(f, "{other}")
            }
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Database(e)
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
