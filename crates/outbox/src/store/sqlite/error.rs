//! SQLite errors the store acts on (the retry classification is
//! `crate::error::codes::sqlite`).

/// Whether `e` is sqlx's `REGEXP` function refusing its input
/// (`SQLITE_CONSTRAINT_FUNCTION`): text that is not UTF-8 (the patterns themselves are
/// checked before they are bound).
pub(super) fn regexp_refused(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("1043"))
}
