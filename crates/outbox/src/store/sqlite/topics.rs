//! Topics matched in Rust rather than by `REGEXP`: the statements over dead letters and
//! over ordered keys take the matching topics as a JSON array.

use crate::error::Result;
use sqlx::AssertSqlSafe;

/// `column`, a topic, is one of the JSON array bound at `param` (from [`dead_topics`]).
/// Read as text, as `REGEXP` reads it, so a topic written by hand as a BLOB compares by
/// its bytes.
pub(super) fn topic_in(column: &str, param: &str) -> String {
    format!("CAST({column} AS TEXT) IN (SELECT value FROM json_each({param}))")
}

/// The distinct topics of dead rows that `matches` accepts, as a JSON array for
/// [`topic_in`]. The statements over dead letters (strict ordering's, selections by
/// topic) match topics here rather than by `REGEXP`: a row quarantined as malformed keeps
/// its topic, and one that is not UTF-8 would fail the whole statement
/// ([`regexp_refused`](super::error::regexp_refused)) for as long as it stays. Such a
/// topic matches no pattern.
pub(super) async fn dead_topics(
    conn: &mut sqlx::SqliteConnection,
    p: &str,
    matches: impl Fn(&str) -> bool,
) -> Result<String> {
    topics_where(conn, p, "status = 3", matches).await
}

/// As [`dead_topics`], over the rows of `condition`.
pub(super) async fn topics_where(
    conn: &mut sqlx::SqliteConnection,
    p: &str,
    condition: &str,
    matches: impl Fn(&str) -> bool,
) -> Result<String> {
    let topics: Vec<Vec<u8>> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT DISTINCT CAST(topic AS BLOB) FROM {p}_messages WHERE {condition}"
    )))
    .fetch_all(&mut *conn)
    .await?;
    let matching: Vec<String> = topics
        .into_iter()
        .filter_map(|t| String::from_utf8(t).ok())
        .filter(|t| matches(t))
        .collect();
    Ok(serde_json::Value::from(matching).to_string())
}
