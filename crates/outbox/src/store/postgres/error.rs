//! PostgreSQL error codes the store acts on (the retry classification is
//! `crate::error::codes`).

/// Whether `e` is the server refusing to send a value's text in the connection's encoding
/// (SQLSTATE 22021 `character_not_in_repertoire`, 22P05 `untranslatable_character`): in a
/// `SQL_ASCII` database a text column holds any bytes, and those that are not UTF-8 fail
/// the whole statement that returns them to a UTF-8 client, as sqlx's is.
pub(super) fn text_not_sendable(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("22021" | "22P05")))
}
