//! SQLSTATE classification.

/// PostgreSQL's SQLSTATEs (<https://www.postgresql.org/docs/current/errcodes-appendix.html>):
/// `40001` serialization failure, `40P01` deadlock detected and `55P03` lock not available
/// are a lost conflict; class `08` (connection exception) and `57P01`–`57P03` (admin or
/// crash shutdown, cannot connect now) are the server being unavailable.
pub(crate) fn classify(sqlstate: &str) -> crate::store::Failure {
    match sqlstate {
        "40001" | "40P01" | "55P03" => crate::store::Failure::Conflict,
        s if s.starts_with("08") || s.starts_with("57P") => crate::store::Failure::Unavailable,
        _ => crate::store::Failure::Other,
    }
}

/// Whether `e` is the server refusing to send a value's text in the connection's encoding
/// (SQLSTATE 22021 `character_not_in_repertoire`, 22P05 `untranslatable_character`): in a
/// `SQL_ASCII` database a text column holds any bytes, and those that are not UTF-8 fail
/// the whole statement that returns them to a UTF-8 client, as sqlx's is.
pub(super) fn text_not_sendable(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("22021" | "22P05")))
}
