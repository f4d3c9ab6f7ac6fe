//! Reading claimed rows into messages: the claim's arrays, and the row-by-row path for a
//! row that does not decode.

use super::claim::{bind_claim, claim_update_ids, col};
use super::error::text_not_sendable;
use super::{PgStore, UTF8_BYTES};
use crate::error::{Error, Result};
use crate::message::OutgoingMessage;
use crate::store::{Claim, ClaimRequest, Dead, parse_headers};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Row};
use uuid::Uuid;

impl PgStore {
    /// Reads one row of the claim's arrays ([`col`], see [`claim_update`]) into `claim`,
    /// without sqlx's per-value type check (the statement fixes every column's type). The
    /// arrays always decode (every element type is one the columns' types allow); a row
    /// whose values do not make a message (headers that are not an object of strings, an
    /// `occurred_at` of `'infinity'`) is malformed on its own. Returns the chunk's ids when
    /// an array itself does not decode (or its decoding panics), so the caller can read those
    /// rows one by one ([`PgStore::read_claimed`]). That is a defence only: in a UTF-8
    /// database every value these columns hold decodes (and a `SQL_ASCII` database's
    /// text that is not UTF-8 is refused by the server before it is sent: see
    /// [`PgStore::claim_then_read`]).
    pub(super) fn chunk_into(row: &PgRow, claim: &mut Claim) -> std::result::Result<(), Vec<i64>> {
        type Columns = (
            Vec<Uuid>,
            Vec<String>,
            Vec<Option<String>>,
            Vec<Vec<u8>>,
            Vec<Option<serde_json::Value>>,
            Vec<f64>,
            Vec<i32>,
        );
        let ids: Vec<i64> = row.try_get_unchecked(col::ID).unwrap_or_default();
        let decode = || -> std::result::Result<Columns, sqlx::Error> {
            Ok((
                row.try_get_unchecked(col::MESSAGE_ID)?,
                row.try_get_unchecked(col::TOPIC)?,
                row.try_get_unchecked(col::KEY)?,
                row.try_get_unchecked(col::PAYLOAD)?,
                row.try_get_unchecked(col::HEADERS)?,
                row.try_get_unchecked(col::OCCURRED_EPOCH)?,
                row.try_get_unchecked(col::ATTEMPTS)?,
            ))
        };
        let columns = std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode));
        let Ok(Ok((message_ids, topics, keys, payloads, headers, occurred, attempts))) = columns
        else {
            return Err(ids);
        };
        let n = ids.len();
        claim.messages.reserve(n);
        if [
            message_ids.len(),
            topics.len(),
            keys.len(),
            payloads.len(),
            headers.len(),
            occurred.len(),
            attempts.len(),
        ]
        .iter()
        .any(|&len| len != n)
        {
            return Err(ids);
        }
        let columns = message_ids
            .into_iter()
            .zip(topics)
            .zip(keys)
            .zip(payloads)
            .zip(headers)
            .zip(occurred)
            .zip(attempts);
        for (&id, ((((((message_id, topic), key), payload), headers), occurred), attempts)) in
            ids.iter().zip(columns)
        {
            let read = || -> Result<OutgoingMessage> {
                Ok(OutgoingMessage {
                    id,
                    message_id,
                    topic,
                    key,
                    payload: bytes::Bytes::from(payload),
                    headers: match headers {
                        Some(h) => parse_headers(id, h)?,
                        None => std::collections::BTreeMap::new(),
                    },
                    occurred_at: epoch_to_time(id, occurred)?,
                    attempts,
                })
            };
            match read() {
                Ok(m) => claim.messages.push(m),
                Err(e) => claim.malformed.push(Dead {
                    id,
                    error: crate::store::malformed_reason(e),
                }),
            }
        }
        Ok(())
    }

    /// The claim of `req` when the usual one failed on a row's text
    /// ([`text_not_sendable`]): the same rows are claimed, returning only their ids, then
    /// read by [`PgStore::read_claimed`], which takes text as bytes, so that a row whose
    /// text is not UTF-8 is one malformed row (quarantined by the relay) instead of a claim
    /// that fails, and keeps failing, for every row with it.
    pub(super) async fn claim_then_read(&self, req: &ClaimRequest, token: Uuid) -> Result<Claim> {
        let sql = self.claim_text(req, &claim_update_ids(self.s()));
        let row = bind_claim(sqlx::query(AssertSqlSafe(sql)), req, token)
            .fetch_optional(&self.inner.pool)
            .await?;
        let Some(row) = row else {
            return Ok(Claim {
                token,
                messages: Vec::new(),
                malformed: Vec::new(),
                db_now: None,
            });
        };
        let ids: Vec<i64> = row.try_get(0)?;
        let mut claim = self.read_claimed(token, &ids).await?;
        claim.db_now = row
            .try_get::<f64, _>(1)
            .ok()
            .and_then(crate::store::epoch_secs_to_time);
        Ok(claim)
    }

    /// The rows of `ids` this claim (`token`) holds, read one row each, their text as UTF-8
    /// bytes checked here (`convert_to`; a `SQL_ASCII` database's text as it is stored, the
    /// server having no encoding to convert from): the claim's path when a row of arrays
    /// did not decode or a row's text could not be sent, so that one bad value makes one
    /// malformed row.
    ///
    /// When even that fails on a row's text (in a database whose encoding is neither UTF-8
    /// nor `SQL_ASCII`, a character with no UTF-8 form, SQLSTATE 22P05), the rows are read
    /// one statement each, and a row that fails so is malformed with the server's reason.
    pub(super) async fn read_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Claim> {
        let s = self.s();
        let sql = format!(
            "SELECT id, message_id, convert_to(topic, {UTF8_BYTES}), convert_to(key, {UTF8_BYTES}),
                    payload, convert_to(headers::text, {UTF8_BYTES}),
                    extract(epoch FROM occurred_at)::float8, attempts
             FROM {s}.messages WHERE id = ANY($1) AND claim_token = $2 AND status <= 1"
        );
        let read = async |ids: &[i64]| {
            sqlx::query(AssertSqlSafe(sql.clone()))
                .bind(ids)
                .bind(token)
                .fetch_all(&self.inner.pool)
                .await
        };
        let rows = match read(ids).await {
            Ok(rows) => rows,
            Err(e) if text_not_sendable(&e) => {
                let mut rows = Vec::with_capacity(ids.len());
                let mut unsendable = Vec::new();
                for &id in ids {
                    match read(&[id]).await {
                        Ok(row) => rows.extend(row),
                        Err(e) if text_not_sendable(&e) => unsendable.push(Dead {
                            id,
                            error: crate::store::malformed_reason(Error::MalformedRow {
                                id,
                                reason: format!("its text cannot be sent as UTF-8 ({e})"),
                            }),
                        }),
                        Err(e) => return Err(e.into()),
                    }
                }
                let mut claim =
                    crate::store::claim_from_rows(token, &rows, Self::row_to_message, |r| {
                        r.try_get::<i64, _>(0).unwrap_or(-1)
                    });
                claim.malformed.extend(unsendable);
                return Ok(claim);
            }
            Err(e) => return Err(e.into()),
        };
        Ok(crate::store::claim_from_rows(
            token,
            &rows,
            Self::row_to_message,
            |r| r.try_get::<i64, _>(0).unwrap_or(-1),
        ))
    }

    /// One row of [`PgStore::read_claimed`], by position.
    pub(super) fn row_to_message(row: &PgRow) -> std::result::Result<OutgoingMessage, Dead> {
        let id: i64 = row.try_get(0).map_err(|e| Dead {
            id: -1,
            error: e.to_string(),
        })?;
        let read = || -> Result<OutgoingMessage> {
            let text = |i: usize, column: &str| -> Result<Option<String>> {
                row.try_get::<Option<Vec<u8>>, _>(i)?
                    .map(|bytes| {
                        String::from_utf8(bytes).map_err(|e| Error::MalformedRow {
                            id,
                            reason: format!("its {column} is not valid UTF-8 ({})", e.utf8_error()),
                        })
                    })
                    .transpose()
            };
            let topic = text(2, "topic")?.unwrap_or_default();
            let key = text(3, "key")?;
            let headers = text(5, "headers")?.unwrap_or_else(|| "{}".into());
            let headers = serde_json::from_str(&headers).map_err(|e| Error::MalformedRow {
                id,
                reason: format!("its headers are not JSON ({e})"),
            })?;
            Ok(OutgoingMessage {
                id,
                message_id: row.try_get(1)?,
                topic,
                key,
                payload: bytes::Bytes::from(row.try_get::<Vec<u8>, _>(4)?),
                headers: parse_headers(id, headers)?,
                occurred_at: epoch_to_time(id, row.try_get(6)?)?,
                attempts: row.try_get(7)?,
            })
        };
        read().map_err(|e| Dead {
            id,
            error: crate::store::malformed_reason(e),
        })
    }
}

/// `occurred_at` comes back as epoch seconds: a hand-written `'infinity'` must become a
/// malformed row, not a decoding panic.
pub(super) fn epoch_to_time(id: i64, secs: f64) -> Result<DateTime<Utc>> {
    if let Some(t) = crate::store::epoch_secs_to_time(secs) {
        return Ok(t);
    }
    Err(Error::MalformedRow {
        id,
        reason: format!("occurred_at is not a representable time ({secs})"),
    })
}
