//! The steps of a replay or discard of dead rows in this store's statements (see
//! [`crate::store::common::replay`]).

use super::{MySqlStore, NOW, REPLAY_CHUNK};
use crate::error::Result;
use crate::store::common;
use crate::store::common::replay::{self, Change, ReplaySteps, Tx};
use crate::store::ops::{self, Dialect};
use crate::store::{ReplayAction, ReplayRequest};
use async_trait::async_trait;
use chrono::NaiveDateTime;
use sqlx::{AssertSqlSafe, MySql, Row};
use std::fmt::Write as _;
use uuid::Uuid;

#[async_trait]
impl ReplaySteps for MySqlStore {
    type Db = MySql;
    /// The keyed rows among the locked ones: (id, order key).
    type Held = Vec<(i64, Vec<u8>)>;
    const DIALECT: Dialect = Dialect::MySql;

    async fn named(&self, tx: &mut Tx<Self>, filter: &str) -> Result<Vec<(i64, Uuid, i16)>> {
        let p = &self.inner.config.schema;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id, message_id, CAST(status AS SIGNED) FROM {p}_messages WHERE {filter}"
        )))
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(|r| {
            let mid: String = r.try_get(1)?;
            let status: i64 = r.try_get(2)?;
            Ok((
                r.try_get::<i64, _>(0)?,
                Uuid::parse_str(&mid).unwrap_or_default(),
                i16::try_from(status).unwrap_or(-1),
            ))
        })
        .collect()
    }

    async fn select(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<Vec<i64>> {
        let p = &self.inner.config.schema;
        // The selected rows, read without locks (no gap locks, and no waiting on rows the
        // selection does not take), then locked by primary key while still dead (the
        // primary key forced: a covering secondary index would look cheaper and lock every
        // dead row, waiting on any a claim or a producer holds): a concurrent replay of the
        // same rows waits there, then finds them no longer dead.
        let (filter, binds) = ops::dead_filter(&req.selector, Dialect::MySql, 1);
        let limit = req
            .limit
            .map_or_else(String::new, |l| format!(" LIMIT {l}"));
        let sql = format!("SELECT id FROM {p}_messages WHERE {filter} ORDER BY id{limit}");
        Ok(replay::bound(sql, binds).fetch_all(&mut **tx).await?)
    }

    async fn lock(&self, tx: &mut Tx<Self>, selected: Vec<i64>) -> Result<(Vec<i64>, Self::Held)> {
        let p = &self.inner.config.schema;
        let mut ids = Vec::with_capacity(selected.len());
        for chunk in selected.chunks(REPLAY_CHUNK) {
            let locked = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT id FROM {p}_messages FORCE INDEX (PRIMARY)
                 WHERE id IN ({}) AND status = 3 ORDER BY id FOR UPDATE",
                Self::id_list(chunk)
            )))
            .fetch_all(&mut **tx)
            .await?;
            for r in &locked {
                ids.push(r.try_get::<i64, _>(0)?);
            }
        }
        // The keyed rows among them (id, order_key), whose parked followers come back below.
        let mut keyed: Vec<(i64, Vec<u8>)> = Vec::new();
        for chunk in ids.chunks(REPLAY_CHUNK) {
            let rows = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT id, order_key FROM {p}_messages
                 WHERE id IN ({}) AND order_key IS NOT NULL",
                Self::id_list(chunk)
            )))
            .fetch_all(&mut **tx)
            .await?;
            for r in &rows {
                keyed.push((r.try_get(0)?, r.try_get(1)?));
            }
        }
        Ok((ids, keyed))
    }

    async fn record(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<i64> {
        let entry = common::ops::replay_entry(req);
        let r = common::ops::audit_query(self.inner.sql.replay_insert.clone(), &entry)
            .execute(&mut **tx)
            .await?;
        Ok(i64::try_from(r.last_insert_id()).unwrap_or(i64::MAX))
    }

    async fn change(&self, tx: &mut Tx<Self>, c: Change<'_>, keyed: Self::Held) -> Result<u64> {
        let Change {
            req,
            ids,
            replay_id,
        } = c;
        let p = &self.inner.config.schema;
        // One database time for every statement, as one statement would have: the spread
        // starts at it whatever the number of statements.
        let at: NaiveDateTime = sqlx::raw_sql(AssertSqlSafe(format!("SELECT {NOW}")))
            .fetch_one(&mut **tx)
            .await?
            .try_get(0)?;
        let at = format!("TIMESTAMP'{}'", at.format("%Y-%m-%d %H:%M:%S%.6f"));
        let mut changed = 0;
        for (c, chunk) in ids.chunks(REPLAY_CHUNK).enumerate() {
            let list = Self::id_list(chunk);
            let sql = match (req.action, req.rate_per_s) {
                (ReplayAction::Replay, None) => format!(
                    "UPDATE {p}_messages
                     SET status = 0, attempts = 0, replay_id = {replay_id}, available_at = {at},
                         claim_token = NULL, locked_until = NULL, dispatched_at = NULL
                     WHERE id IN ({list}) AND status = 3"
                ),
                (ReplayAction::Replay, Some(_)) => {
                    // Each row due at its place in id order at the rate: an inlined derived
                    // table of (id, delay), as `settle` does.
                    let mut rows = String::with_capacity(chunk.len() * 40);
                    for (k, id) in chunk.iter().enumerate() {
                        if k > 0 {
                            rows.push_str(" UNION ALL ");
                        }
                        let delay = ops::spread_ms(c * REPLAY_CHUNK + k, req.rate_per_s);
                        let _ = write!(rows, "SELECT {id} AS id, {delay} AS delay_ms");
                    }
                    format!(
                        "UPDATE {p}_messages m JOIN ({rows}) x ON m.id = x.id
                         SET m.available_at = TIMESTAMPADD(MICROSECOND, x.delay_ms * 1000, {at}),
                             m.attempts = 0, m.replay_id = {replay_id}, m.claim_token = NULL,
                             m.locked_until = NULL, m.dispatched_at = NULL, m.status = 0
                         WHERE m.status = 3"
                    )
                }
                (ReplayAction::Discard | ReplayAction::Purge, _) => {
                    format!("DELETE FROM {p}_messages WHERE id IN ({list}) AND status = 3")
                }
            };
            changed += sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut **tx)
                .await?
                .rows_affected();
        }
        // A replayed row is due after its spread delay (its followers then, too); a deleted
        // one releases its followers at once.
        let delay_of = replay::delays(req, ids);
        let delayed: Vec<(i64, Vec<u8>, i64)> = keyed
            .into_iter()
            .map(|(id, ok)| (id, ok, delay_of.get(&id).copied().unwrap_or(0)))
            .collect();
        self.unpark_keys(tx, &delayed, &at).await?;
        Ok(changed)
    }

    async fn count(&self, tx: &mut Tx<Self>, changed: u64, replay_id: i64) -> Result<()> {
        sqlx::query(self.inner.sql.replay_count.clone())
            .bind(i64::try_from(changed).unwrap_or(i64::MAX))
            .bind(replay_id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}
