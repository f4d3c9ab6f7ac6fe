//! The claim: its statements (the plain and the ordered select of due ids, the ordered
//! claim's fences), the claim transaction, and decoding claimed rows.

use super::{MySqlStore, NOW, regexp_any, retry_deadlock};
use crate::error::Result;
use crate::message::OutgoingMessage;
use crate::store::common;
use crate::store::{Claim, ClaimRequest, Dead, PauseState, Relaying, Settled, Settlement, millis};
use async_trait::async_trait;
use chrono::NaiveDateTime;
use sqlx::mysql::MySqlRow;
use sqlx::{AssertSqlSafe, MySql, Row, Transaction};
use std::fmt::Write as _;
use std::time::Duration;
use tokio::sync::watch;
use uuid::Uuid;

/// The claim's select of due ids, with `extra` appended to the filter. It honours the
/// pause switch and the topic pauses itself: both tests are uncorrelated subqueries the
/// server evaluates once, and the topic regexes are matched row by row only when a topic
/// pause exists (`OR` stops at its left side); a pause whose regex is not filled in yet
/// holds every topic (fail closed) until `migrate` fills it. The subqueries are plain
/// reads: `FOR UPDATE` locks only the rows of the outer table (checked on MariaDB 10.11).
pub(super) fn claim_select(p: &str, extra: &str) -> String {
    format!(
        "SELECT id FROM {p}_messages m
         WHERE live_at <= {NOW}{extra}
           AND NOT EXISTS (SELECT 1 FROM {p}_control c WHERE c.id = 1 AND c.paused)
           AND (NOT EXISTS (SELECT 1 FROM {p}_topic_pauses)
                OR NOT EXISTS (SELECT 1 FROM {p}_topic_pauses tp
                               WHERE tp.regex IS NULL OR m.topic REGEXP tp.regex))
         ORDER BY live_at, id
         LIMIT ?
         FOR UPDATE SKIP LOCKED"
    )
}

/// The ordered claim's first step (see `MySqlStore::claim_ordered_ids`): `ordered`
/// regexes bound twice (the `ord` column, then the head test), then `skip` regexes, then
/// the limit.
pub(super) fn ordered_select(p: &str, ordered: usize, skip: usize, skip_dead: bool) -> String {
    let ord = regexp_any("m.topic", ordered);
    let dead_h = if skip_dead { " AND h.status <> 3" } else { "" };
    let skip: String = (0..skip).map(|_| " AND m.topic NOT REGEXP ?").collect();
    let head_ready = format!(
        " AND (m.order_key IS NULL OR NOT ({ord}) OR COALESCE(
              (SELECT h.status = 3 OR h.available_at > m.available_at
               FROM {p}_messages h FORCE INDEX ({p}_messages_key)
               WHERE h.order_key = m.order_key{dead_h} ORDER BY h.id LIMIT 1), 0) = 0){skip}"
    );
    claim_select(p, &head_ready).replacen(
        "SELECT id FROM",
        &format!(
            "SELECT id, CAST(order_key IS NOT NULL AND ({ord}) AS SIGNED) AS ord, order_key FROM"
        ),
        1,
    )
}

/// The ordered claim's fences: per key hash of `rows` (a derived table of `ok` values), its
/// first row not dispatched (nor dead, with `skip_dead`) outside the ids `list`.
pub(super) fn fence_sql(p: &str, skip_dead: bool, list: &str, rows: &str) -> String {
    let dead_e = if skip_dead { " AND e.status <> 3" } else { "" };
    format!(
        "SELECT x.ok, (SELECT e.id FROM {p}_messages e FORCE INDEX ({p}_messages_key)
                       WHERE e.order_key = x.ok{dead_e} AND e.id NOT IN ({list})
                       ORDER BY e.id LIMIT 1) AS fence
         FROM ({rows}) x"
    )
}

impl MySqlStore {
    /// One claim transaction (see [`Relaying::claim`](crate::store::Relaying::claim)); [`retry_deadlock`] reruns it.
    async fn claim_once(&self, req: &ClaimRequest) -> Result<Claim> {
        let token = Uuid::now_v7();
        let p = &self.inner.config.schema;
        let mut tx = self.inner.pool.begin().await?;
        let ids: Vec<i64> = if req.ordering.is_on() {
            self.claim_ordered_ids(&mut tx, req).await?
        } else if req.skip_topics.is_empty() {
            sqlx::query_scalar(self.inner.sql.claim_select.clone())
                .bind(i64::from(req.batch_size))
                .fetch_all(&mut *tx)
                .await?
        } else {
            // Topic pauses: the same range of the live index, passing over rows whose topic
            // matches a paused pattern (the patterns' regexes bound, one per pattern).
            let skip: String = req
                .skip_topics
                .iter()
                .map(|_| " AND topic NOT REGEXP ?")
                .collect();
            let mut query = sqlx::query_scalar(AssertSqlSafe(claim_select(p.as_str(), &skip)));
            for t in &req.skip_topics {
                query = query.bind(t.regex());
            }
            query
                .bind(i64::from(req.batch_size))
                .fetch_all(&mut *tx)
                .await?
        };
        if ids.is_empty() {
            tx.commit().await?;
            return Ok(Claim {
                token,
                messages: Vec::new(),
                malformed: Vec::new(),
                db_now: None,
            });
        }
        // Text protocol with inlined values: see `update_ids`.
        let list = Self::id_list(&ids);
        let relay = Self::text_literal(&req.relay_id);
        let token_text = token.hyphenated();
        let lease = millis(req.lease);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "UPDATE {p}_messages
             SET status = 1, attempts = LEAST(attempts, 2147483646) + 1, claimed_by = {relay},
                 claim_token = '{token_text}',
                 locked_until = TIMESTAMPADD(MICROSECOND, {lease} * 1000, {NOW}),
                 available_at = TIMESTAMPADD(MICROSECOND, {lease} * 1000, {NOW})
             WHERE id IN ({list})"
        )))
        .execute(&mut *tx)
        .await?;
        let rows = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id, message_id, topic, `key`, payload, headers, occurred_at, attempts,
                    {NOW} AS db_now
             FROM {p}_messages WHERE id IN ({list}) ORDER BY id"
        )))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut claim = crate::store::claim_from_rows(token, &rows, Self::row_to_message, |r| {
            r.try_get::<i64, _>("id").unwrap_or(-1)
        });
        claim.db_now = rows
            .first()
            .and_then(|r| r.try_get::<NaiveDateTime, _>("db_now").ok())
            .map(|t| t.and_utc());
        Ok(claim)
    }

    /// The plans MySQL/MariaDB chooses for the ordered claim's two reads of `req` (the
    /// candidates, then the fences), one line per `EXPLAIN` row as `table key`: which
    /// indexes an ordered claim reads, for tests and for operators.
    ///
    /// # Errors
    /// Database errors.
    pub async fn explain_ordered_claim(&self, req: &ClaimRequest) -> Result<String> {
        let p = self.inner.config.schema.as_str();
        let regexes = req.ordering.regexes();
        let select = ordered_select(p, regexes.len(), 0, req.ordering.skip_dead);
        let mut query = sqlx::query(AssertSqlSafe(format!("EXPLAIN {select}")));
        for re in regexes.iter().chain(regexes.iter()) {
            query = query.bind(re.as_str());
        }
        let mut rows = query
            .bind(i64::from(req.batch_size))
            .fetch_all(&self.inner.pool)
            .await?;
        let fence = fence_sql(p, req.ordering.skip_dead, "0", "SELECT X'00' AS ok");
        rows.extend(
            sqlx::raw_sql(AssertSqlSafe(format!("EXPLAIN {fence}")))
                .fetch_all(&self.inner.pool)
                .await?,
        );
        let col = |r: &MySqlRow, name: &str| -> String {
            r.try_get::<Option<String>, _>(name)
                .ok()
                .flatten()
                .or_else(|| {
                    r.try_get::<Option<Vec<u8>>, _>(name)
                        .ok()
                        .flatten()
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                })
                .unwrap_or_else(|| "-".into())
        };
        Ok(rows
            .iter()
            .map(|r| format!("{} {}", col(r, "table"), col(r, "key")))
            .collect::<Vec<_>>()
            .join("\n"))
    }

    /// The ids an ordered claim takes ([`crate::store::KeyOrdering`]), the rows locked in `tx`:
    ///
    /// 1. the due rows as the unordered claim selects them (`FOR UPDATE SKIP LOCKED`),
    ///    less those of an ordered key whose first row not dispatched (its head, by the
    ///    `order_key` index) comes after them in the claim's order (claimed under a live
    ///    lease, waiting for a retry, given back later) or is dead when dead rows hold
    ///    their key: a blocked key never fills the claim, and a row taken has its key's
    ///    head before it, so every key makes progress;
    /// 2. per ordered key among them, its fence: the first row of the key not dispatched
    ///    (nor dead, with `skip_dead`) that the first step did not lock: cut off by the
    ///    limit, locked by another claim, or not ready;
    /// 3. the rows before their key's fence are taken; the others stay as they are.
    ///
    /// The per-key reads name the `order_key` index (`FORCE INDEX`): with one hot key
    /// holding most rows, the optimizer would otherwise walk the primary key for `ORDER BY
    /// id LIMIT 1` and pass every dispatched row of the key on each read.
    ///
    /// Rows are matched by `order_key` alone: a hash collision between two keys can only
    /// hold one back behind the other, never let a row pass its own key's fence.
    async fn claim_ordered_ids(
        &self,
        tx: &mut Transaction<'static, MySql>,
        req: &ClaimRequest,
    ) -> Result<Vec<i64>> {
        let p = &self.inner.config.schema;
        let regexes = req.ordering.regexes();
        let skip_dead = req.ordering.skip_dead;
        let select = ordered_select(p.as_str(), regexes.len(), req.skip_topics.len(), skip_dead);
        let mut query = sqlx::query_as::<_, (i64, i64, Option<Vec<u8>>)>(AssertSqlSafe(select));
        for re in regexes.iter().chain(regexes.iter()) {
            query = query.bind(re.as_str());
        }
        for t in &req.skip_topics {
            query = query.bind(t.regex());
        }
        let cand = query
            .bind(i64::from(req.batch_size))
            .fetch_all(&mut **tx)
            .await?;
        let mut keys: Vec<&[u8]> = cand
            .iter()
            .filter(|(_, ord, _)| *ord != 0)
            .filter_map(|(_, _, k)| k.as_deref())
            .collect();
        keys.sort_unstable();
        keys.dedup();
        if keys.is_empty() {
            return Ok(cand.into_iter().map(|(id, _, _)| id).collect());
        }
        let all: Vec<i64> = cand.iter().map(|(id, _, _)| *id).collect();
        let list = Self::id_list(&all);
        let mut rows = String::with_capacity(keys.len() * 48);
        for (i, k) in keys.iter().enumerate() {
            if i > 0 {
                rows.push_str(" UNION ALL ");
            }
            rows.push_str("SELECT X'");
            for b in *k {
                let _ = write!(rows, "{b:02x}");
            }
            rows.push_str("' AS ok");
        }
        let fences: Vec<(Vec<u8>, Option<i64>)> = sqlx::raw_sql(AssertSqlSafe(fence_sql(
            p.as_str(),
            skip_dead,
            &list,
            &rows,
        )))
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect::<Result<_>>()?;
        let fence: std::collections::HashMap<Vec<u8>, i64> = fences
            .into_iter()
            .filter_map(|(k, f)| f.map(|f| (k, f)))
            .collect();
        Ok(cand
            .into_iter()
            .filter(|(id, ord, k)| {
                *ord == 0 || k.as_ref().and_then(|k| fence.get(k)).is_none_or(|f| id < f)
            })
            .map(|(id, _, _)| id)
            .collect())
    }

    fn row_to_message(row: &MySqlRow) -> std::result::Result<OutgoingMessage, Dead> {
        common::decode::text_row(row, |_, at: NaiveDateTime| Ok(at.and_utc()))
    }
}

#[async_trait]
impl Relaying for MySqlStore {
    fn kind(&self) -> &'static str {
        "mysql"
    }

    async fn check_schema(&self) -> Result<()> {
        self.verify_schema().await
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim> {
        retry_deadlock(|| self.claim_once(req)).await
    }

    async fn settle(&self, token: Uuid, settlement: &Settlement) -> Result<Settled> {
        self.settle_claim(token, settlement).await
    }

    async fn delete_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        self.delete_claim(token, ids).await
    }

    async fn renew(&self, token: Uuid, ids: &[i64], lease: Duration) -> Result<Vec<i64>> {
        self.renew_claim(token, ids, lease).await
    }

    async fn pause_state(&self) -> Result<PauseState> {
        self.read_pause_state().await
    }

    fn wakeups(&self) -> watch::Receiver<u64> {
        self.subscribe_wakeups()
    }

    fn nothing_due(&self, poll_interval: Duration) -> bool {
        self.probe_says_nothing_due(poll_interval)
    }
}
