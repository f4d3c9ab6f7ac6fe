//! Settling claimed rows (one statement over every outcome), deleting them, and renewing
//! their leases.

use super::{MySqlStore, NOW, retry_deadlock};
use crate::error::Result;
use crate::store::{Settled, Settlement, millis};
use sqlx::{AssertSqlSafe, Row};
use std::fmt::Write as _;
use std::time::Duration;
use uuid::Uuid;

impl MySqlStore {
    pub(super) async fn settle_claim(
        &self,
        token: Uuid,
        settlement: &Settlement,
    ) -> Result<Settled> {
        let _wrote = self.inner.quiet.writing();
        if settlement.delete_dispatched && !settlement.dispatched.is_empty() {
            return crate::store::settle_deleting(self, token, settlement).await;
        }
        retry_deadlock(|| self.settle_once(token, settlement)).await
    }

    /// One settle statement (see [`Relaying::settle`](crate::store::Relaying::settle)); [`retry_deadlock`] reruns it.
    async fn settle_once(&self, token: Uuid, settlement: &Settlement) -> Result<Settled> {
        if settlement.is_empty() {
            return Ok(Settled::default());
        }
        let p = &self.inner.config.schema;
        // One multi-table UPDATE over an inlined derived table of outcomes. MySQL has no
        // UPDATE … RETURNING: when fewer rows changed than were sent, a second query
        // finds the rows another claim now holds (the lost ones).
        let mut rows = String::with_capacity(settlement.len() * 64);
        for (i, (id, st, delay, err, refund)) in crate::store::settle_rows(settlement)
            .into_iter()
            .enumerate()
        {
            let err = err.map_or_else(
                || "CAST(NULL AS CHAR CHARACTER SET utf8mb4)".to_owned(),
                |e| Self::text_literal(&e),
            );
            if i > 0 {
                rows.push_str(" UNION ALL ");
            }
            let _ = write!(
                rows,
                "SELECT {id} AS id, {st} AS st, {delay} AS delay_ms, {err} AS err, {} AS refund",
                i32::from(refund)
            );
        }
        let token_text = token.hyphenated();
        // Assignments that read the row come before `status` changes (MySQL applies
        // multi-table assignments in no promised order, but the WHERE was evaluated first).
        let sql = format!(
            "UPDATE {p}_messages m JOIN ({rows}) x ON m.id = x.id
             SET m.available_at = CASE WHEN x.st = 0 THEN TIMESTAMPADD(MICROSECOND, x.delay_ms * 1000, {NOW})
                                       WHEN x.st = 3 THEN {NOW} ELSE m.available_at END,
                 m.attempts = CASE WHEN x.refund = 1 THEN GREATEST(m.attempts - 1, 0) ELSE m.attempts END,
                 m.dispatched_at = CASE WHEN x.st = 2 THEN {NOW} ELSE m.dispatched_at END,
                 m.last_error = CASE WHEN x.st = 2 THEN NULL ELSE COALESCE(x.err, m.last_error) END,
                 m.locked_until = NULL, m.claim_token = NULL, m.status = x.st
             WHERE m.claim_token = '{token_text}' AND m.status = 1"
        );
        let n = sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.inner.pool)
            .await?
            .rows_affected();
        let ids = settlement.ids();
        if n >= ids.len() as u64 {
            return Ok(crate::store::settled(settlement, ids));
        }
        if n == 0 {
            return Ok(crate::store::settled(settlement, Vec::new()));
        }
        // Some changed: the rows another claim holds now are certainly lost. A row that
        // was already settled by its new owner cannot be told from one settled here, so
        // the rest are attributed by count (this only affects which ids a log names).
        let held: Vec<i64> = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id FROM {p}_messages WHERE id IN ({}) AND claim_token IS NOT NULL",
            Self::id_list(&ids)
        )))
        .fetch_all(&self.inner.pool)
        .await?
        .iter()
        .map(|r| r.try_get::<i64, _>(0))
        .collect::<std::result::Result<_, _>>()?;
        let changed = ids
            .into_iter()
            .filter(|id| !held.contains(id))
            .take(usize::try_from(n).unwrap_or(usize::MAX))
            .collect();
        Ok(crate::store::settled(settlement, changed))
    }

    pub(super) async fn delete_claim(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        retry_deadlock(|| self.delete_claimed_once(token, ids)).await
    }

    /// One deleting transaction (see [`Relaying::delete_claimed`](crate::store::Relaying::delete_claimed)); [`retry_deadlock`] reruns it.
    async fn delete_claimed_once(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        let p = &self.inner.config.schema;
        let list = &Self::id_list(ids);
        let token_text = token.hyphenated();
        // No DELETE … RETURNING in MySQL: the rows this claim still holds are read and
        // locked first, in the same transaction, and exactly those are deleted.
        let mut tx = self.inner.pool.begin().await?;
        let held: Vec<i64> = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id FROM {p}_messages
                 WHERE id IN ({list}) AND claim_token = '{token_text}' AND status = 1
                 FOR UPDATE"
        )))
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| r.try_get::<i64, _>("id").unwrap_or(-1))
        .collect();
        if !held.is_empty() {
            let held_list = Self::id_list(&held);
            sqlx::raw_sql(AssertSqlSafe(format!(
                    "DELETE FROM {p}_messages WHERE id IN ({held_list}) AND claim_token = '{token_text}'"
                )))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(held)
    }

    pub(super) async fn renew_claim(
        &self,
        token: Uuid,
        ids: &[i64],
        lease: Duration,
    ) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let p = &self.inner.config.schema;
        let list = Self::id_list(ids);
        let token_text = token.hyphenated();
        let ms = millis(lease);
        let n = sqlx::raw_sql(AssertSqlSafe(format!(
            "UPDATE {p}_messages
             SET locked_until = TIMESTAMPADD(MICROSECOND, {ms} * 1000, {NOW}),
                 available_at = TIMESTAMPADD(MICROSECOND, {ms} * 1000, {NOW})
             WHERE id IN ({list}) AND claim_token = '{token_text}' AND status = 1"
        )))
        .execute(&self.inner.pool)
        .await?
        .rows_affected();
        if n >= ids.len() as u64 {
            return Ok(ids.to_vec());
        }
        let held = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id FROM {p}_messages
             WHERE id IN ({list}) AND claim_token = '{token_text}' AND status = 1"
        )))
        .fetch_all(&self.inner.pool)
        .await?
        .iter()
        .map(|r| r.try_get::<i64, _>(0))
        .collect::<std::result::Result<_, _>>()?;
        Ok(held)
    }
}
