//! The SQL entry points for other languages judge headers alike: one table of header cases
//! runs against PostgreSQL's `outbox.enqueue(...)` and MariaDB's `CALL outbox_enqueue(...)`,
//! and each case gets the same verdict (accepted, or refused with the same SQLSTATE) from
//! both, so a bad header is refused in the producer's transaction on either database
//! instead of being quarantined later.

#![allow(clippy::unwrap_used)]

use crate::common::{MySqlPrefix, mysql_connect, mysql_url, pg_store_with};
use outbox::StoreConfig;
use outbox::mysql::MySqlStore;
use outbox::store::prelude::*;
use sqlx::AssertSqlSafe;

/// The limit both stores are migrated with, so one case can exceed it by its headers.
const LIMIT: usize = 1_000;

/// Accepted, or refused with this SQLSTATE.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    Accepted,
    Refused(String),
}

use Verdict::{Accepted, Refused};

fn refused(state: &str) -> Verdict {
    Refused(state.to_owned())
}

/// (what, the headers argument as JSON text (`None`: SQL NULL), the verdict both give).
fn cases() -> Vec<(&'static str, Option<String>, Verdict)> {
    let long_name = format!("{{\"{}\":\"x\"}}", "n".repeat(256));
    let max_name = format!("{{\"{}\":\"x\"}}", "n".repeat(255));
    let too_large = format!("{{\"big\":\"{}\"}}", "v".repeat(LIMIT));
    let s = |t: &str| Some(t.to_owned());
    vec![
        // Accepted.
        ("SQL NULL (no headers)", None, Accepted),
        ("empty object", s("{}"), Accepted),
        (
            "envelope headers",
            s(
                r#"{"content-type":"application/json","traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}"#,
            ),
            Accepted,
        ),
        (
            "every token character",
            s(r#"{"Az09!#$%&'*+-.^_`|~":"v"}"#),
            Accepted,
        ),
        ("a 255-character name", Some(max_name), Accepted),
        ("empty value", s(r#"{"x-empty":""}"#), Accepted),
        ("non-ASCII value", s(r#"{"x-note":"été ☃"}"#), Accepted),
        (
            "reserved names are exact (case-sensitive)",
            s(r#"{"Topic":"x"}"#),
            Accepted,
        ),
        // Refused: not a JSON object of strings.
        ("null value", s(r#"{"x":null}"#), refused("22023")),
        ("number value", s(r#"{"x":1}"#), refused("22023")),
        ("boolean value", s(r#"{"x":true}"#), refused("22023")),
        ("object value", s(r#"{"x":{"y":"z"}}"#), refused("22023")),
        ("array value", s(r#"{"x":["y"]}"#), refused("22023")),
        (
            "one bad value among good ones",
            s(r#"{"a":"x","b":2}"#),
            refused("22023"),
        ),
        ("non-object: array", s(r#"["a","b"]"#), refused("22023")),
        ("non-object: string", s(r#""text""#), refused("22023")),
        ("non-object: JSON null", s("null"), refused("22023")),
        // Refused: names that are not HTTP tokens.
        ("name with a space", s(r#"{"a b":"x"}"#), refused("22023")),
        ("name with a colon", s(r#"{"a:b":"x"}"#), refused("22023")),
        ("empty name", s(r#"{"":"x"}"#), refused("22023")),
        ("non-ASCII name", s(r#"{"é":"x"}"#), refused("22023")),
        (
            "Kelvin sign (folds to k without a byte comparison)",
            s("{\"\u{212A}ey\":\"x\"}"),
            refused("22023"),
        ),
        (
            "escaped space in a name",
            s(r#"{"a\u0020b":"x"}"#),
            refused("22023"),
        ),
        ("a 256-character name", Some(long_name), refused("22023")),
        // Refused: reserved names.
        (
            "reserved message-id",
            s(r#"{"message-id":"x"}"#),
            refused("22023"),
        ),
        ("reserved topic", s(r#"{"topic":"x"}"#), refused("22023")),
        ("reserved key", s(r#"{"key":"x"}"#), refused("22023")),
        (
            "reserved occurred-at",
            s(r#"{"occurred-at":"x"}"#),
            refused("22023"),
        ),
        // Refused: the size limit counts header names and values.
        (
            "headers over the size limit",
            Some(too_large),
            refused("54000"),
        ),
    ]
}

fn verdict_of<T>(r: Result<T, sqlx::Error>) -> Verdict {
    match r {
        Ok(_) => Accepted,
        Err(sqlx::Error::Database(db)) => Refused(db.code().unwrap_or_default().into_owned()),
        Err(e) => panic!("not a database error: {e}"),
    }
}

/// A migrated MariaDB store under its own table prefix, failing loudly when MariaDB is down.
async fn mariadb(label: &str) -> (MySqlStore, MySqlPrefix) {
    drop(mysql_connect().await);
    let prefix = MySqlPrefix::new(label);
    let my = MySqlStore::connect(
        &mysql_url(),
        StoreConfig {
            schema: prefix.ident(),
            max_message_bytes: LIMIT,
        },
    )
    .await
    .unwrap();
    my.migrate().await.unwrap();
    (my, prefix)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_and_mariadb_judge_every_header_case_alike() {
    let (pg, schema) = pg_store_with("hdr", LIMIT).await;
    let (my, prefix) = mariadb("hdr").await;
    my.check_schema().await.unwrap();
    let (s, p) = (&schema.name, &prefix.name);

    let mut mismatches = Vec::new();
    let mut accepted = 0;
    for (what, headers, expected) in cases() {
        // Each call in its own transaction (autocommit), as a producer's would be.
        let on_pg = verdict_of(
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
                "SELECT {s}.enqueue('t.hdr.v1', 'x'::bytea, NULL, NULL, $1::jsonb)"
            )))
            .bind(headers.as_deref())
            .fetch_one(pg.pool())
            .await,
        );
        let on_my = verdict_of(
            sqlx::query(AssertSqlSafe(format!(
                "CALL {p}_enqueue('t.hdr.v1', 'x', NULL, NULL, ?)"
            )))
            .bind(headers.as_deref())
            .fetch_one(my.pool())
            .await,
        );
        if on_pg != expected || on_my != expected {
            mismatches.push(format!(
                "{what} ({headers:?}): expected {expected:?}, PostgreSQL {on_pg:?}, MariaDB {on_my:?}"
            ));
        }
        accepted += usize::from(expected == Accepted);
    }
    assert!(
        mismatches.is_empty(),
        "verdicts differ:\n{}",
        mismatches.join("\n")
    );
    // Refused calls wrote nothing; accepted ones one row each.
    let on_pg = pg.counts().await.unwrap().pending;
    let on_my = my.counts().await.unwrap().pending;
    assert_eq!((on_pg, on_my), (accepted as i64, accepted as i64));
}

/// The refusal says what is wrong (MariaDB's MESSAGE_TEXT names the bad header).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_refusals_say_what_is_wrong() {
    let (my, prefix) = mariadb("hdrmsg").await;
    let p = &prefix.name;
    for (headers, says) in [
        (
            r#"{"x":null}"#,
            "JSON object of strings (a value is a JSON null)",
        ),
        (
            r#"{"x":1}"#,
            "JSON object of strings (a value is a JSON integer)",
        ),
        (r#"{"a:b":"x"}"#, "header name 'a:b' is not"),
        (r#"{"topic":"x"}"#, "header topic is reserved"),
        (r#"[]"#, "headers must be a JSON object of strings"),
    ] {
        let e = sqlx::query(AssertSqlSafe(format!(
            "CALL {p}_enqueue('t.hdr.v1', 'x', NULL, NULL, ?)"
        )))
        .bind(headers)
        .fetch_one(my.pool())
        .await
        .unwrap_err();
        assert!(e.to_string().contains(says), "{headers}: {e}");
    }
}
