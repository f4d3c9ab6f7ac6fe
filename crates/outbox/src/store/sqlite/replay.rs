//! The steps of a replay or discard of dead rows in this store's statements (see
//! [`crate::store::common::replay`]).

use super::ops::dead_filter;
use super::{NOW_MS, SqliteStore, ids_json};
use crate::error::Result;
use crate::store::common;
use crate::store::common::replay::{self, Change, ReplaySteps, Tx};
use crate::store::ops::{self, Dialect};
use crate::store::{PARKED_AT_MS, ReplayAction, ReplayRequest};
use async_trait::async_trait;
use sqlx::{AssertSqlSafe, Row, Sqlite};
use uuid::Uuid;

#[async_trait]
impl ReplaySteps for SqliteStore {
    type Db = Sqlite;
    type Held = ();
    const DIALECT: Dialect = Dialect::Sqlite;

    async fn named(&self, tx: &mut Tx<Self>, filter: &str) -> Result<Vec<(i64, Uuid, i16)>> {
        let p = self.p();
        let rows: Vec<(i64, String, i16)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, message_id, status FROM {p}_messages WHERE {filter}"
        )))
        .fetch_all(&mut **tx)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, m, st)| (id, Uuid::parse_str(&m).unwrap_or_default(), st))
            .collect())
    }

    async fn select(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<Vec<i64>> {
        let p = self.p();
        let (filter, binds) = dead_filter(tx, p, &req.selector).await?;
        let limit = req.limit.map_or(i64::MAX, i64::from);
        let sql = format!("SELECT id FROM {p}_messages WHERE {filter} ORDER BY id LIMIT {limit}");
        Ok(replay::bound(sql, binds).fetch_all(&mut **tx).await?)
    }

    async fn lock(&self, _: &mut Tx<Self>, selected: Vec<i64>) -> Result<(Vec<i64>, ())> {
        Ok((selected, ()))
    }

    async fn record(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<i64> {
        let sql = AssertSqlSafe(format!(
            "INSERT INTO {}_replays (requested_by, reason, action, selection)
             VALUES (?1, ?2, ?3, ?4) RETURNING id",
            self.p()
        ));
        let row = common::ops::audit_query(sql, &common::ops::replay_entry(req))
            .fetch_one(&mut **tx)
            .await?;
        Ok(row.try_get(0)?)
    }

    async fn change(&self, tx: &mut Tx<Self>, c: Change<'_>, (): ()) -> Result<u64> {
        let Change {
            req,
            ids,
            replay_id,
        } = c;
        let p = self.p();
        let n = NOW_MS;
        // The keyed rows among them, whose parked followers are given back below. A key
        // that is not UTF-8 is left out (its followers, malformed too, come back with the
        // relays' periodic give-back of what no dead letter holds).
        let keyed: Vec<(i64, Vec<u8>, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, CAST(topic AS BLOB), CAST(key AS BLOB) FROM {p}_messages
             WHERE id IN (SELECT value FROM json_each(?1)) AND typeof(key) = 'text'
               AND typeof(topic) = 'text'"
        )))
        .bind(ids_json(ids))
        .fetch_all(&mut **tx)
        .await?;
        let keyed: Vec<(i64, String, String)> = keyed
            .into_iter()
            .filter_map(|(id, t, k)| {
                Some((id, String::from_utf8(t).ok()?, String::from_utf8(k).ok()?))
            })
            .collect();
        let changed = match req.action {
            ReplayAction::Replay => {
                let rows: Vec<serde_json::Value> = ids
                    .iter()
                    .enumerate()
                    .map(|(k, id)| serde_json::json!([id, ops::spread_ms(k, req.rate_per_s)]))
                    .collect();
                sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {p}_messages AS m
                     SET status = 0, attempts = 0, available_at = {n} + x.delay_ms, replay_id = ?2,
                         claim_token = NULL, locked_until = NULL, dispatched_at = NULL
                     FROM (SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS delay_ms
                           FROM json_each(?1)) AS x
                     WHERE m.id = x.id AND m.status = 3"
                )))
                .bind(serde_json::Value::from(rows).to_string())
                .bind(replay_id)
                .execute(&mut **tx)
                .await?
                .rows_affected()
            }
            ReplayAction::Discard | ReplayAction::Purge => sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {p}_messages WHERE id IN (SELECT value FROM json_each(?1)) AND status = 3"
            )))
            .bind(ids_json(ids))
            .execute(&mut **tx)
            .await?
            .rows_affected(),
        };
        // A replayed row is due after its spread delay (its followers then, too); a deleted
        // one releases its followers now. Each key's parked rows before its next dead
        // letter come back.
        let delay_of = replay::delays(req, ids);
        let released: Vec<serde_json::Value> = keyed
            .iter()
            .map(|(id, t, k)| serde_json::json!([id, t, k, delay_of.get(id).copied().unwrap_or(0)]))
            .collect();
        if !released.is_empty() {
            sqlx::query(AssertSqlSafe(format!(
                "WITH r AS (
                   SELECT json_extract(value, '$[1]') AS topic, json_extract(value, '$[2]') AS key,
                          min(json_extract(value, '$[0]')) AS id, min(json_extract(value, '$[3]')) AS at_ms
                   FROM json_each(?1) GROUP BY 1, 2),
                 k AS (
                   SELECT r.*, (SELECT min(d.id) FROM {p}_messages d
                                WHERE d.topic = r.topic AND d.key = r.key AND d.key IS NOT NULL
                                  AND d.status <> 2 AND d.status = 3) AS next_dead
                   FROM r)
                 UPDATE {p}_messages AS m SET available_at = {n} + max(k.at_ms, 0)
                 FROM k
                 WHERE m.topic = k.topic AND m.key = k.key AND m.key IS NOT NULL
                   AND m.status <> 2 AND m.status = 0 AND m.available_at = {PARKED_AT_MS}
                   AND m.id > k.id AND (k.next_dead IS NULL OR m.id < k.next_dead)"
            )))
            .bind(serde_json::Value::from(released).to_string())
            .execute(&mut **tx)
            .await?;
        }
        Ok(changed)
    }

    async fn count(&self, tx: &mut Tx<Self>, changed: u64, replay_id: i64) -> Result<()> {
        let p = self.p();
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {p}_replays SET count = count + ?1 WHERE id = ?2"
        )))
        .bind(changed as i64)
        .bind(replay_id)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}
