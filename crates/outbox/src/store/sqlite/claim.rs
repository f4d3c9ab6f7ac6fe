//! The claim: one `UPDATE … RETURNING` over the due rows, the ordered claim's steps, and
//! the claim of the rows whose topic `REGEXP` refuses.

use super::decode::ms_to_time;
use super::error::regexp_refused;
use super::{NOW_MS, SqliteStore, ids_json};
use crate::error::{Error, Result};
use crate::store::{Claim, ClaimRequest, millis};
use crate::topic::TopicPattern;
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, Sqlite, Transaction};
use uuid::Uuid;

/// [`lease_free`](crate::store::lease_free) on SQLite's clock.
pub(super) fn lease_free(alias: &str) -> String {
    crate::store::lease_free(alias, NOW_MS)
}

/// The claim statement; with `skip` topic regexes bound as ?5, ?6, … (the topic pauses,
/// read in the claim's transaction, and any the caller adds). It writes only columns no
/// index reads (`attempts`, `claimed_by`, `claim_token`, `locked_until`): a claimed row
/// keeps `status` and `available_at` and is claimed while it holds a token under a live
/// lease ([`lease_free`]), so SQLite changes no index entry for it (it rewrites the
/// indexes whose columns or partial-index conditions a statement changes: `status` and
/// `available_at` touched the live, dead and per-key indexes). Claim + mark of 20,000
/// keyed ~300-byte rows in 1,000-row batches: 1,136 → 987 WAL bytes and about half the
/// time per message. It honours the pause switch
/// itself (an uncorrelated subquery SQLite evaluates once per statement). The regexes are
/// bound rather than joined from the pauses table: SQLite keeps a compiled pattern only
/// for a constant argument, so a pattern from a column would be compiled again per row.
pub(super) fn claim_sql(p: &str, skip: usize) -> String {
    let n = NOW_MS;
    let skip: String = (0..skip)
        .map(|i| format!(" AND topic NOT REGEXP ?{}", i + 5))
        .collect();
    format!(
        "UPDATE {p}_messages
         SET attempts = min(attempts, 2147483646) + 1, claimed_by = ?1, claim_token = ?2,
             locked_until = {n} + ?3
         WHERE id IN (SELECT id FROM {p}_messages
                      WHERE status <= 1 AND available_at <= {n}{lease}{skip}
                        AND NOT EXISTS (SELECT 1 FROM {p}_control c WHERE c.id = 1 AND c.paused)
                      ORDER BY available_at, id LIMIT ?4)
         RETURNING id, message_id, topic, key, payload, headers, occurred_at, attempts, {n} AS now_ms",
        lease = lease_free("")
    )
}

/// `column REGEXP ?first OR …` over `count` parameters from `?first` (`0`, false, when
/// `count` is 0).
fn regexp_any(column: &str, first: usize, count: usize) -> String {
    if count == 0 {
        return "0".to_owned();
    }
    (first..first + count)
        .map(|i| format!("{column} REGEXP ?{i}"))
        .collect::<Vec<_>>()
        .join(" OR ")
}

/// The ordered claim's first step ([`crate::store::KeyOrdering`]): the due rows as [`claim_sql`]
/// selects them, with whether each is of an ordered key, less the rows of an ordered key
/// whose first row not dispatched (its head) comes after them in the claim's order
/// (claimed under a live lease, waiting for a retry, given back later) or is dead when dead
/// rows hold their key: a blocked key never fills the claim, and a row taken has its key's
/// head before it, so every key makes progress. `?1` is the limit, `?2 … ?{ordered+1}` the ordered topics' regexes, then `skip`
/// regexes to pass over (the topic pauses).
fn claim_ordered_select(p: &str, ordered: usize, skip: usize, skip_dead: bool) -> String {
    let n = NOW_MS;
    let ord = regexp_any("topic", 2, ordered);
    let skip: String = (0..skip)
        .map(|i| format!(" AND topic NOT REGEXP ?{}", i + 2 + ordered))
        .collect();
    let dead_h = if skip_dead { " AND h.status <> 3" } else { "" };
    format!(
        "SELECT id, CAST(topic AS BLOB), CAST(key AS BLOB), (key IS NOT NULL AND ({ord})) AS ord
         FROM {p}_messages m
         WHERE status <= 1 AND available_at <= {n}{lease}{skip}
           AND NOT EXISTS (SELECT 1 FROM {p}_control c WHERE c.id = 1 AND c.paused)
           AND (key IS NULL OR NOT ({ord}) OR coalesce(
                 (SELECT h.status = 3 OR h.available_at > m.available_at
                         OR coalesce(h.locked_until > {n}, 0) FROM {p}_messages h
                  WHERE h.topic = m.topic AND h.key = m.key AND h.status <> 2{dead_h}
                  ORDER BY h.id LIMIT 1), 0) = 0)
         ORDER BY available_at, id LIMIT ?1",
        lease = lease_free("")
    )
}

/// The ordered claim's second step: per key of `?2` (a JSON array of `[topic, key]`), its
/// fence, the first row not dispatched (nor dead, with `skip_dead`) outside the first
/// step's rows `?1` (cut off by the limit, or not ready). Rows before it are taken.
fn claim_fence_sql(p: &str, skip_dead: bool) -> String {
    let dead_e = if skip_dead { " AND e.status <> 3" } else { "" };
    format!(
        "WITH k(topic, key) AS (
           SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?2))
         SELECT k.topic, k.key,
                (SELECT e.id FROM {p}_messages e
                 WHERE e.topic = k.topic AND e.key = k.key AND e.status <> 2{dead_e}
                   AND e.id NOT IN (SELECT value FROM json_each(?1))
                 ORDER BY e.id LIMIT 1) AS fence
         FROM k"
    )
}

/// The ordered claim's last step: claims the rows of `?4` (a JSON array of ids).
fn claim_ids_sql(p: &str) -> String {
    let n = NOW_MS;
    format!(
        "UPDATE {p}_messages
         SET attempts = min(attempts, 2147483646) + 1, claimed_by = ?1, claim_token = ?2,
             locked_until = {n} + ?3
         WHERE id IN (SELECT value FROM json_each(?4))
         RETURNING id, message_id, topic, key, payload, headers, occurred_at, attempts, {n} AS now_ms"
    )
}

impl SqliteStore {
    /// The plans SQLite chooses for the ordered claim's two reads of `req` (the candidates,
    /// then the fences), as `EXPLAIN QUERY PLAN` details joined by newlines: which
    /// indexes an ordered claim reads, for tests and for operators checking a large file.
    ///
    /// # Errors
    /// Database errors.
    pub async fn explain_ordered_claim(&self, req: &ClaimRequest) -> Result<String> {
        let regexes = req.ordering.regexes();
        let skip_dead = req.ordering.skip_dead;
        let select = claim_ordered_select(self.p(), regexes.len(), 0, skip_dead);
        let mut query = sqlx::query(AssertSqlSafe(format!("EXPLAIN QUERY PLAN {select}")))
            .bind(i64::from(req.batch_size));
        for re in &regexes {
            query = query.bind(re.as_str());
        }
        let mut lines: Vec<String> = Vec::new();
        for r in query.fetch_all(&self.inner.pool).await? {
            lines.push(r.try_get("detail")?);
        }
        let fence = claim_fence_sql(self.p(), skip_dead);
        let rows = sqlx::query(AssertSqlSafe(format!("EXPLAIN QUERY PLAN {fence}")))
            .bind("[1]")
            .bind(r#"[["t","k"]]"#)
            .fetch_all(&self.inner.pool)
            .await?;
        for r in rows {
            lines.push(r.try_get("detail")?);
        }
        Ok(lines.join("\n"))
    }

    /// One claim (see [`Relaying::claim`](crate::store::Relaying::claim)).
    async fn claim_once(&self, req: &ClaimRequest) -> Result<Claim> {
        let token = Uuid::now_v7();
        // BEGIN IMMEDIATE takes the write lock up front (waiting under the busy timeout),
        // so the claim never fails half-way as a read that cannot upgrade to a write.
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        // The topic pauses, under the same write lock as the claim.
        let pauses: Vec<(String, Option<String>)> =
            sqlx::query_as(self.inner.sql.topic_pauses.clone())
                .fetch_all(&mut *tx)
                .await?;
        let mut skip: Vec<String> = req.skip_topics.iter().map(TopicPattern::regex).collect();
        for (pattern, regex) in pauses {
            skip.push(regex.unwrap_or_else(|| crate::store::pause_regex(&pattern)));
        }
        if req.ordering.is_on() {
            let ids = Self::claim_ordered_ids(&mut tx, self.p(), req, &skip).await?;
            let rows = if ids.is_empty() {
                Vec::new()
            } else {
                Self::claim_ids(&mut tx, self.p(), req, token, &ids).await?
            };
            tx.commit().await?;
            return Ok(Self::claim_of(token, &rows));
        }
        let sql = if skip.is_empty() {
            self.inner.sql.claim.clone()
        } else {
            AssertSqlSafe(claim_sql(self.p(), skip.len())).into_sql_str()
        };
        let mut query = sqlx::query(sql)
            .bind(&req.relay_id)
            .bind(token.hyphenated().to_string())
            .bind(millis(req.lease))
            .bind(i64::from(req.batch_size));
        for re in skip {
            query = query.bind(re);
        }
        let rows = query.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(Self::claim_of(token, &rows))
    }

    /// The claim when the `REGEXP` function refused a topic that is not UTF-8 (it fails
    /// the whole statement, and would fail every claim that reads that row: the ordered
    /// claim and topic pauses match topics against patterns). The due rows whose topic is
    /// not UTF-8 are claimed (up to the batch size), to come back malformed and be
    /// quarantined; the next claim takes the rest. Nothing while the pause switch is on.
    /// `None` when no due row has such a topic (the error was something else).
    async fn claim_unmatchable_topics(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        let token = Uuid::now_v7();
        let p = self.p();
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        let paused: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {p}_control WHERE id = 1 AND paused)"
        )))
        .fetch_one(&mut *tx)
        .await?;
        if paused {
            return Ok(Some(Self::claim_of(token, &[])));
        }
        let due: Vec<(i64, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, CAST(topic AS BLOB) FROM {p}_messages
             WHERE status <= 1 AND available_at <= {NOW_MS}{lease} ORDER BY available_at, id",
            lease = lease_free("")
        )))
        .fetch_all(&mut *tx)
        .await?;
        let ids: Vec<i64> = due
            .into_iter()
            .filter(|(_, topic)| std::str::from_utf8(topic).is_err())
            .map(|(id, _)| id)
            .take(req.batch_size as usize)
            .collect();
        if ids.is_empty() {
            return Ok(None);
        }
        let rows = Self::claim_ids(&mut tx, p, req, token, &ids).await?;
        tx.commit().await?;
        Ok(Some(Self::claim_of(token, &rows)))
    }

    /// Claims the rows `ids` for `req` under `token` ([`claim_ids_sql`]), returning them.
    async fn claim_ids(
        tx: &mut Transaction<'static, Sqlite>,
        p: &str,
        req: &ClaimRequest,
        token: Uuid,
        ids: &[i64],
    ) -> Result<Vec<SqliteRow>> {
        Ok(sqlx::query(AssertSqlSafe(claim_ids_sql(p)))
            .bind(&req.relay_id)
            .bind(token.hyphenated().to_string())
            .bind(millis(req.lease))
            .bind(ids_json(ids))
            .fetch_all(&mut **tx)
            .await?)
    }

    /// The claim of the rows the claim statement returned.
    fn claim_of(token: Uuid, rows: &[SqliteRow]) -> Claim {
        let mut claim = crate::store::claim_from_rows(token, rows, Self::row_to_message, |r| {
            r.try_get::<i64, _>("id").unwrap_or(-1)
        });
        claim.db_now = rows
            .first()
            .and_then(|r| r.try_get::<i64, _>("now_ms").ok())
            .map(ms_to_time);
        claim
    }

    /// The ids an ordered claim takes, in the claim's transaction (which holds the write
    /// lock, so nothing changes between the steps): see [`claim_ordered_select`] and
    /// [`claim_fence_sql`].
    async fn claim_ordered_ids(
        tx: &mut Transaction<'static, Sqlite>,
        p: &str,
        req: &ClaimRequest,
        skip: &[String],
    ) -> Result<Vec<i64>> {
        let regexes = req.ordering.regexes();
        let sql = claim_ordered_select(p, regexes.len(), skip.len(), req.ordering.skip_dead);
        // Topic and key as bytes: a row written by hand with a BLOB or non-UTF-8 topic or
        // key must not fail the claim (it is claimed as unordered, then quarantined as
        // malformed when read).
        let mut query =
            sqlx::query_as::<_, (i64, Vec<u8>, Option<Vec<u8>>, bool)>(AssertSqlSafe(sql))
                .bind(i64::from(req.batch_size));
        for re in regexes.iter().chain(skip) {
            query = query.bind(re.as_str());
        }
        let cand: Vec<(i64, String, Option<String>, bool)> = query
            .fetch_all(&mut **tx)
            .await?
            .into_iter()
            .map(|(id, topic, key, ord)| {
                let topic = String::from_utf8(topic).ok();
                let key = key.map(String::from_utf8);
                match (topic, key) {
                    (Some(t), Some(Ok(k))) => (id, t, Some(k), ord),
                    (Some(t), None) => (id, t, None, ord),
                    _ => (id, String::new(), None, false),
                }
            })
            .collect();
        let mut keys: Vec<(&str, &str)> = cand
            .iter()
            .filter(|c| c.3)
            .filter_map(|(_, t, k, _)| Some((t.as_str(), k.as_deref()?)))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        if keys.is_empty() {
            return Ok(cand.into_iter().map(|c| c.0).collect());
        }
        let all: Vec<i64> = cand.iter().map(|c| c.0).collect();
        let fences: Vec<(String, String, Option<i64>)> =
            sqlx::query_as(AssertSqlSafe(claim_fence_sql(p, req.ordering.skip_dead)))
                .bind(ids_json(&all))
                .bind(serde_json::to_string(&keys).unwrap_or_default())
                .fetch_all(&mut **tx)
                .await?;
        let fence: std::collections::HashMap<(String, String), i64> = fences
            .into_iter()
            .filter_map(|(t, k, f)| Some(((t, k), f?)))
            .collect();
        Ok(cand
            .into_iter()
            .filter(|(id, t, k, ord)| {
                !*ord
                    || k.as_ref()
                        .and_then(|k| fence.get(&(t.clone(), k.clone())))
                        .is_none_or(|f| id < f)
            })
            .map(|c| c.0)
            .collect())
    }

    pub(super) async fn claim(&self, req: &ClaimRequest) -> Result<Claim> {
        match self.claim_once(req).await {
            Err(Error::Database(e)) if regexp_refused(&e) => self
                .claim_unmatchable_topics(req)
                .await?
                .ok_or(Error::Database(e)),
            claimed => claimed,
        }
    }
}
