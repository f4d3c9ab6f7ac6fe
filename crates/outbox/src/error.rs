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
            Error::Database(e) => classify(e) != Failure::Other,
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
                if let Some(n) = codes::mysql::error_number(self.0) {
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

/// What a database error says about trying again, decided by the store whose driver raised
/// it (each database's codes are mapped in [`codes`]: `codes::postgres::classify`,
/// `codes::mysql::classify`, `codes::sqlite::classify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The transaction lost a conflict (serialization failure, deadlock, lock timeout, a
    /// busy SQLite database) and was rolled back: run it again.
    Conflict,
    /// The connection or the server (lost connection, shutdown, too many connections): the
    /// same call can succeed later.
    Unavailable,
    /// The statement itself: the same call fails again.
    Other,
}

/// Classifies `e` ([`Failure`]): connection-level errors here, database errors by the
/// store of the driver that raised them.
pub(crate) fn classify(e: &sqlx::Error) -> Failure {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_)
        | sqlx::Error::Tls(_) => Failure::Unavailable,
        sqlx::Error::Database(db) => {
            #[cfg(feature = "postgres")]
            if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
                return codes::postgres::classify(pg.code());
            }
            #[cfg(feature = "mysql")]
            if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                return codes::mysql::classify(my.number());
            }
            #[cfg(feature = "sqlite")]
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                return codes::sqlite::classify(db.code().as_deref().unwrap_or_default());
            }
            Failure::Other
        }
        _ => Failure::Other,
    }
}

/// Each database's error codes as [`Failure`]s: the driver-specific tables [`classify`]
/// reads (the MySQL store reads `mysql::error_number` too).
pub(crate) mod codes {
    #[cfg(feature = "postgres")]
    pub(crate) mod postgres {
        use super::super::Failure;

        /// PostgreSQL's SQLSTATEs
        /// (<https://www.postgresql.org/docs/current/errcodes-appendix.html>): `40001`
        /// serialization failure, `40P01` deadlock detected and `55P03` lock not available
        /// are a lost conflict; class `08` (connection exception) and `57P01`–`57P03`
        /// (admin or crash shutdown, cannot connect now) are the server being unavailable.
        pub(crate) fn classify(sqlstate: &str) -> Failure {
            match sqlstate {
                "40001" | "40P01" | "55P03" => Failure::Conflict,
                s if s.starts_with("08") || s.starts_with("57P") => Failure::Unavailable,
                _ => Failure::Other,
            }
        }
    }

    #[cfg(feature = "mysql")]
    pub(crate) mod mysql {
        use super::super::Failure;

        /// The MySQL error number of `e`, if it is a server error.
        pub(crate) fn error_number(e: &sqlx::Error) -> Option<u16> {
            match e {
                sqlx::Error::Database(db) => db
                    .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                    .map(|m| m.number()),
                _ => None,
            }
        }

        /// MySQL/MariaDB error numbers
        /// (<https://dev.mysql.com/doc/mysql-errors/8.0/en/server-error-reference.html>,
        /// <https://mariadb.com/kb/en/mariadb-error-code-reference/>): 1205 lock wait timeout
        /// and 1213 deadlock are a lost conflict; 1040 too many connections, 1053 server
        /// shutdown, 1317 query interrupted and 1927 connection killed (MariaDB) are the
        /// server being unavailable.
        pub(crate) fn classify(number: u16) -> Failure {
            match number {
                1205 | 1213 => Failure::Conflict,
                1040 | 1053 | 1317 | 1927 => Failure::Unavailable,
                _ => Failure::Other,
            }
        }
    }

    #[cfg(feature = "sqlite")]
    pub(crate) mod sqlite {
        use super::super::Failure;

        /// SQLite result codes (<https://www.sqlite.org/rescode.html>): `SQLITE_BUSY` (5)
        /// and `SQLITE_LOCKED` (6), whose extended codes keep the primary code in the low
        /// byte, are a lost conflict (another writer holds the lock).
        pub(crate) fn classify(code: &str) -> Failure {
            match code.parse::<u32>() {
                Ok(n) if matches!(n & 0xff, 5 | 6) => Failure::Conflict,
                _ => Failure::Other,
            }
        }
    }
}

#[cfg(test)]
mod failure_tests {
    use super::Failure;

    #[test]
    fn each_store_maps_its_own_codes() {
        #[cfg(feature = "postgres")]
        {
            use super::codes::postgres::classify;
            assert_eq!(classify("40001"), Failure::Conflict);
            assert_eq!(classify("40P01"), Failure::Conflict);
            assert_eq!(classify("57P01"), Failure::Unavailable);
            assert_eq!(classify("08006"), Failure::Unavailable);
            assert_eq!(classify("23505"), Failure::Other);
        }
        #[cfg(feature = "mysql")]
        {
            use super::codes::mysql::classify;
            assert_eq!(classify(1213), Failure::Conflict);
            assert_eq!(classify(1205), Failure::Conflict);
            assert_eq!(classify(1053), Failure::Unavailable);
            assert_eq!(classify(1062), Failure::Other);
        }
        #[cfg(feature = "sqlite")]
        {
            use super::codes::sqlite::classify;
            assert_eq!(classify("5"), Failure::Conflict);
            assert_eq!(classify("517"), Failure::Conflict); // SQLITE_BUSY_SNAPSHOT
            assert_eq!(classify("262"), Failure::Conflict); // SQLITE_LOCKED_SHAREDCACHE
            assert_eq!(classify("2067"), Failure::Other); // SQLITE_CONSTRAINT_UNIQUE
            // PostgreSQL's five-character SQLSTATEs never parse as SQLite codes.
            assert_eq!(classify("40001"), Failure::Other);
        }
        assert_eq!(
            super::classify(&sqlx::Error::PoolTimedOut),
            Failure::Unavailable
        );
    }
}
