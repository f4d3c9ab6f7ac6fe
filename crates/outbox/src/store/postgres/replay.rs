//! The steps of a replay or discard of dead rows in this store's statements (see
//! [`crate::store::common::replay`]).

use super::{PgStore, UTF8_BYTES, schema_sql};
use crate::error::Result;
use crate::store::common;
use crate::store::common::replay::{self, Change, ReplaySteps, Tx};
use crate::store::ops::{self, Dialect};
use crate::store::{ReplayAction, ReplayRequest};
use async_trait::async_trait;
use sqlx::{AssertSqlSafe, Postgres, Row};
use uuid::Uuid;

#[async_trait]
impl ReplaySteps for PgStore {
    type Db = Postgres;
    type Held = ();
    const DIALECT: Dialect = Dialect::Postgres;

    async fn named(&self, tx: &mut Tx<Self>, filter: &str) -> Result<Vec<(i64, Uuid, i16)>> {
        let s = self.s();
        Ok(sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, message_id, status FROM {s}.messages WHERE {filter}"
        )))
        .fetch_all(&mut **tx)
        .await?)
    }

    async fn select(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<Vec<i64>> {
        let s = self.s();
        let (filter, binds) = ops::dead_filter(&req.selector, Dialect::Postgres, 1);
        let limit = req
            .limit
            .map_or_else(|| "ALL".to_owned(), |l| l.to_string());
        // Locks the selected rows: a concurrent replay of the same rows waits, then finds
        // them no longer dead.
        let sql = format!(
            "SELECT id FROM {s}.messages WHERE {filter} ORDER BY id LIMIT {limit} FOR UPDATE"
        );
        Ok(replay::bound(sql, binds).fetch_all(&mut **tx).await?)
    }

    async fn lock(&self, _: &mut Tx<Self>, selected: Vec<i64>) -> Result<(Vec<i64>, ())> {
        Ok((selected, ()))
    }

    async fn record(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<i64> {
        let sql = AssertSqlSafe(schema_sql(include_str!("sql/replay_record.sql"), self.s()));
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
        let s = self.s();
        // The keyed rows among them, whose parked followers are given back below; their
        // text as bytes, which any row's text can be sent as (see `read_claimed`).
        let keyed: Vec<(i64, Vec<u8>, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, convert_to(topic, {UTF8_BYTES}), convert_to(key, {UTF8_BYTES})
             FROM {s}.messages WHERE id = ANY($1) AND key IS NOT NULL"
        )))
        .bind(ids)
        .fetch_all(&mut **tx)
        .await?;
        let delays: Vec<i64> = (0..ids.len())
            .map(|k| ops::spread_ms(k, req.rate_per_s))
            .collect();
        let changed = match req.action {
            ReplayAction::Replay => sqlx::query(AssertSqlSafe(schema_sql(
                include_str!("sql/replay_dead.sql"),
                s,
            )))
            .bind(ids)
            .bind(&delays)
            .bind(replay_id)
            .execute(&mut **tx)
            .await?
            .rows_affected(),
            ReplayAction::Discard | ReplayAction::Purge => sqlx::query(AssertSqlSafe(schema_sql(
                include_str!("sql/discard_dead.sql"),
                s,
            )))
            .bind(ids)
            .execute(&mut **tx)
            .await?
            .rows_affected(),
        };
        // A replayed row is due after its spread delay (its followers then, too); a deleted
        // one releases its followers now.
        let delay_of = replay::delays(req, ids);
        let at = |id: i64| delay_of.get(&id).copied().unwrap_or(0);
        self.unpark_keys(
            tx,
            &keyed.iter().map(|k| k.0).collect::<Vec<_>>(),
            &keyed.iter().map(|k| k.1.clone()).collect::<Vec<_>>(),
            &keyed.iter().map(|k| k.2.clone()).collect::<Vec<_>>(),
            &keyed.iter().map(|k| at(k.0)).collect::<Vec<_>>(),
        )
        .await?;
        Ok(changed)
    }

    async fn count(&self, tx: &mut Tx<Self>, changed: u64, replay_id: i64) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(schema_sql(
            include_str!("sql/replay_count.sql"),
            s,
        )))
        .bind(changed as i64)
        .bind(replay_id)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}
