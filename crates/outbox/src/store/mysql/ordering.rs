//! Per-key ordering: parking the rows held behind a dead letter, giving them back, and
//! the views of held keys.

use super::{MySqlStore, NOW, PARKED, REPLAY_CHUNK, regexp_any};
use crate::error::Result;
use crate::store::{DueHeld, HeldKeys, KeyOrdering};
use sqlx::{AssertSqlSafe, MySql, Row, Transaction};
use std::fmt::Write as _;

/// Lower-case hex of `bytes` (an `order_key`, for an `X'…'` literal).
fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

impl MySqlStore {
    /// Runs `op` on one connection under the parking lock (`GET_LOCK`, waiting up to
    /// `wait_s` seconds): one parker at a time, so two relays never update the same parked
    /// rows in different orders. `Ok(0)` when another connection holds it past that.
    async fn under_parking_lock<F>(&self, wait_s: u32, op: F) -> Result<u64>
    where
        F: AsyncFnOnce(&mut sqlx::pool::PoolConnection<MySql>) -> Result<u64>,
    {
        let p = &self.inner.config.schema;
        let mut conn = self.inner.pool.acquire().await?;
        let lock = format!("outbox_park_{p}");
        let got: Option<i64> = sqlx::query_scalar(self.inner.sql.lock_wait.clone())
            .bind(&lock)
            .bind(wait_s)
            .fetch_one(&mut *conn)
            .await?;
        if got != Some(1) {
            return Ok(0);
        }
        let r = op(&mut conn).await;
        let _ = sqlx::query(self.inner.sql.lock_release.clone())
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        r
    }

    /// Gives back the parked rows of the keys of `rows` (the replayed, discarded or purged
    /// dead letters: id, `order_key`, and the replayed one's delay from `at` in ms) that
    /// come before their key's next dead letter: at the replayed row's own time, so it
    /// still goes first, or at `at` for a deleted one. In the replay's transaction, after
    /// its change. Rows are matched by `order_key`, as the ordered claim matches them.
    pub(super) async fn unpark_keys(
        &self,
        tx: &mut Transaction<'static, MySql>,
        rows: &[(i64, Vec<u8>, i64)],
        at: &str,
    ) -> Result<()> {
        let p = &self.inner.config.schema;
        // The earliest replayed row of each key, with its delay.
        let mut first: std::collections::BTreeMap<&[u8], (i64, i64)> = Default::default();
        for (id, ok, delay) in rows {
            let e = first.entry(ok.as_slice()).or_insert((*id, *delay));
            if *id < e.0 {
                *e = (*id, *delay);
            }
        }
        let keys: Vec<(&[u8], i64, i64)> = first.into_iter().map(|(k, (i, d))| (k, i, d)).collect();
        for chunk in keys.chunks(REPLAY_CHUNK) {
            let mut derived = String::with_capacity(chunk.len() * 80);
            for (k, (ok, id, delay)) in chunk.iter().enumerate() {
                if k > 0 {
                    derived.push_str(" UNION ALL ");
                }
                let _ = write!(
                    derived,
                    "SELECT X'{}' AS ok, {id} AS id, {delay} AS delay_ms",
                    hex(ok)
                );
            }
            // The key's next dead letter bounds what comes back (read first: the target
            // table cannot be read in the update's own subqueries).
            let bounds = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT r.ok, r.id, r.delay_ms,
                        (SELECT MIN(d.id) FROM {p}_messages d FORCE INDEX ({p}_messages_key)
                         WHERE d.order_key = r.ok AND d.id > r.id AND d.status = 3)
                 FROM ({derived}) r"
            )))
            .fetch_all(&mut **tx)
            .await?;
            let mut with_bounds = String::with_capacity(chunk.len() * 100);
            for (k, row) in bounds.iter().enumerate() {
                let ok: Vec<u8> = row.try_get(0)?;
                let id: i64 = row.try_get(1)?;
                let delay: i64 = row.try_get(2)?;
                let next: Option<i64> = row.try_get(3)?;
                if k > 0 {
                    with_bounds.push_str(" UNION ALL ");
                }
                let _ = write!(
                    with_bounds,
                    "SELECT X'{}' AS ok, {id} AS id, {delay} AS delay_ms, {} AS next_dead",
                    hex(&ok),
                    next.unwrap_or(i64::MAX)
                );
            }
            if with_bounds.is_empty() {
                continue;
            }
            sqlx::raw_sql(AssertSqlSafe(format!(
                "UPDATE {p}_messages m FORCE INDEX ({p}_messages_key) JOIN ({with_bounds}) r
                   ON m.order_key = r.ok AND m.id > r.id AND m.id < r.next_dead
                 SET m.available_at = TIMESTAMPADD(MICROSECOND, r.delay_ms * 1000, {at})
                 WHERE m.live_at = '{PARKED}' AND m.status = 0"
            )))
            .execute(&mut **tx)
            .await?;
        }
        Ok(())
    }

    pub(super) async fn park_held_rows(&self, ordering: &KeyOrdering) -> Result<u64> {
        if !ordering.holds_dead() {
            return Ok(0);
        }
        let p = self.inner.config.schema.clone();
        let regexes = ordering.regexes();
        self.under_parking_lock(0, async |conn| {
            let ord = regexp_any("topic", regexes.len());
            let mut tx = sqlx::Connection::begin(&mut **conn).await?;
            // The dead letters are locked (a replay or discard holding one is skipped: it
            // releases its key): a replay that comes after waits for this transaction and
            // then gives the parked rows back itself.
            let mut query = sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
                "SELECT id FROM {p}_messages FORCE INDEX ({p}_messages_dead)
                 WHERE dead_at IS NOT NULL AND order_key IS NOT NULL AND ({ord})
                 FOR UPDATE SKIP LOCKED"
            )));
            for re in &regexes {
                query = query.bind(re.as_str());
            }
            let dead = query.fetch_all(&mut *tx).await?;
            let mut parked = 0;
            for chunk in dead.chunks(REPLAY_CHUNK) {
                parked += sqlx::raw_sql(AssertSqlSafe(format!(
                    "UPDATE {p}_messages m FORCE INDEX ({p}_messages_key)
                     JOIN (SELECT MIN(order_key) AS ok, topic, `key`, MIN(id) AS id
                           FROM {p}_messages WHERE id IN ({}) AND status = 3
                           GROUP BY topic, `key`) b
                       ON m.order_key = b.ok AND m.topic = b.topic AND m.`key` = b.`key`
                      AND m.id > b.id
                     SET m.available_at = '{PARKED}'
                     WHERE m.status = 0 AND m.live_at <= {NOW}",
                    Self::id_list(chunk)
                )))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            }
            tx.commit().await?;
            Ok(parked)
        })
        .await
    }

    pub(super) async fn unpark_released_rows(&self, ordering: &KeyOrdering) -> Result<u64> {
        let _wrote = self.inner.quiet.writing();
        let p = self.inner.config.schema.clone();
        let strict = ordering.holds_dead();
        let regexes = ordering.regexes();
        self.under_parking_lock(10, async |conn| {
            // The first parked row of each key, and whether a dead letter still holds it.
            let ord = regexp_any("f.topic", regexes.len());
            let mut query = sqlx::query_as::<_, (i64, i64)>(AssertSqlSafe(format!(
                "SELECT f.id, CAST(({ord}) AND EXISTS (
                          SELECT 1 FROM {p}_messages d FORCE INDEX ({p}_messages_key)
                          WHERE d.order_key = f.ok AND d.topic = f.topic AND d.`key` = f.`key`
                            AND d.status = 3 AND d.id < f.id) AS SIGNED)
                 FROM (SELECT MIN(order_key) AS ok, topic, `key`, MIN(id) AS id
                       FROM {p}_messages FORCE INDEX ({p}_messages_live)
                       WHERE live_at = '{PARKED}' GROUP BY topic, `key`) f"
            )));
            for re in &regexes {
                query = query.bind(re.as_str());
            }
            let firsts = query.fetch_all(&mut **conn).await?;
            let free: Vec<i64> = firsts
                .into_iter()
                .filter(|(_, held)| !strict || *held == 0)
                .map(|(id, _)| id)
                .collect();
            let mut given = 0;
            for chunk in free.chunks(REPLAY_CHUNK) {
                given += sqlx::raw_sql(AssertSqlSafe(format!(
                    "UPDATE {p}_messages m FORCE INDEX ({p}_messages_key)
                     JOIN {p}_messages f ON f.id IN ({})
                      AND m.order_key = f.order_key AND m.topic = f.topic AND m.`key` = f.`key`
                     SET m.available_at = {NOW}
                     WHERE m.live_at = '{PARKED}' AND m.status = 0",
                    Self::id_list(chunk)
                )))
                .execute(&mut **conn)
                .await?
                .rows_affected();
            }
            Ok(given)
        })
        .await
    }

    pub(super) async fn count_held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys> {
        if !ordering.is_on() {
            return Ok(HeldKeys::default());
        }
        let p = &self.inner.config.schema;
        let regexes = ordering.regexes();
        let ord = regexp_any("topic", regexes.len());
        let mut query = sqlx::query_as::<_, (i64, i64, Option<i64>)>(AssertSqlSafe(format!(
            "WITH blocked AS (
               SELECT MIN(order_key) AS order_key, topic, `key`, MIN(id) AS id FROM {p}_messages
               WHERE status = 3 AND `key` IS NOT NULL AND ({ord}) GROUP BY topic, `key`),
             held AS (
               SELECT m.occurred_at FROM blocked b JOIN {p}_messages m FORCE INDEX ({p}_messages_key)
                 ON m.order_key = b.order_key AND m.topic = b.topic AND m.`key` = b.`key`
                AND m.status <= 1 AND m.id > b.id)
             SELECT CAST((SELECT COUNT(*) FROM blocked) AS SIGNED),
                    CAST((SELECT COUNT(*) FROM held) AS SIGNED),
                    CAST((SELECT TIMESTAMPDIFF(SECOND, MIN(occurred_at), {NOW}) FROM held) AS SIGNED)"
        )));
        for re in &regexes {
            query = query.bind(re.as_str());
        }
        let (blocked_keys, held, oldest) = query.fetch_one(&self.inner.pool).await?;
        Ok(HeldKeys {
            blocked_keys,
            held,
            oldest_held_age_seconds: oldest,
        })
    }

    pub(super) async fn count_due_held(&self, ordering: &KeyOrdering) -> Result<DueHeld> {
        let p = &self.inner.config.schema;
        let regexes = ordering.regexes();
        let ord = regexp_any("m.topic", regexes.len());
        let dead_h = if ordering.skip_dead {
            " AND h.status <> 3"
        } else {
            ""
        };
        // The key's head is read as the ordered claim reads it (see `ordered_select`), and
        // only for the due rows of ordered keys.
        let mut query = sqlx::query_as::<_, (i64, Option<i64>)>(AssertSqlSafe(format!(
            "SELECT CAST(COALESCE(SUM(held), 0) AS SIGNED),
                    CAST(TIMESTAMPDIFF(SECOND, MIN(CASE WHEN held = 0 THEN live_at END), {NOW}) AS SIGNED)
             FROM (
               SELECT m.live_at,
                      CASE WHEN m.order_key IS NOT NULL AND ({ord}) THEN COALESCE(
                        (SELECT h.id <> m.id AND (h.status = 3 OR h.available_at > {NOW})
                         FROM {p}_messages h FORCE INDEX ({p}_messages_key)
                         WHERE h.order_key = m.order_key{dead_h} ORDER BY h.id LIMIT 1), 0)
                      ELSE 0 END AS held
               FROM {p}_messages m WHERE m.live_at <= {NOW}) d"
        )));
        for re in &regexes {
            query = query.bind(re.as_str());
        }
        let (held, oldest_free) = query.fetch_one(&self.inner.pool).await?;
        Ok(DueHeld {
            held,
            oldest_free_due_s: oldest_free.map(|s| s.max(0)),
        })
    }
}
