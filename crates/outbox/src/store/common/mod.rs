//! What the three stores do alike, written once: the orchestration of an operation, generic
//! over the database, with the statements that differ supplied by each store (a small
//! trait, or the statements and decoded rows passed in).

#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) mod decode;
pub(crate) mod enqueue;
pub(crate) mod ops;
pub(crate) mod registry;
pub(crate) mod replay;
pub(crate) mod retention;
pub(crate) mod schema;
pub(crate) mod views;

/// A query of a store's database with its arguments.
pub(crate) type Query<'q, DB> = sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>;

/// The rows a statement changed, for each store's query result.
pub(crate) trait Affected {
    /// Rows inserted, updated or deleted.
    fn affected(&self) -> u64;
}

#[cfg(feature = "postgres")]
impl Affected for sqlx::postgres::PgQueryResult {
    fn affected(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "mysql")]
impl Affected for sqlx::mysql::MySqlQueryResult {
    fn affected(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "sqlite")]
impl Affected for sqlx::sqlite::SqliteQueryResult {
    fn affected(&self) -> u64 {
        self.rows_affected()
    }
}
