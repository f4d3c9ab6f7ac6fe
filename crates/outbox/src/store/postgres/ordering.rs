//! Per-key ordering: parking the rows dead letters hold, giving them back, and what is
//! held.

use super::{AVAILABLE_AT, OCCURRED_AT, PgStore, UTF8_BYTES};
use crate::error::Result;
use crate::store::{DueHeld, HeldKeys, KeyOrdering, PARKED_AT};
use sqlx::{AssertSqlSafe, Postgres, Transaction};

impl PgStore {
    /// One parker at a time ([`Maintenance::park_held`](crate::store::Maintenance::park_held),
    /// [`Maintenance::unpark_released`](crate::store::Maintenance::unpark_released)): two
    /// relays updating the same parked rows in different orders could deadlock. With
    /// `wait`, waits for it (a park is one statement); else false when another
    /// transaction holds it.
    pub(super) async fn parking_lock(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        wait: bool,
    ) -> Result<bool> {
        let key = format!("outbox-park-{}", self.s());
        if wait {
            sqlx::query(include_str!("sql/advisory_xact_lock.sql"))
                .bind(key)
                .execute(&mut **tx)
                .await?;
            return Ok(true);
        }
        Ok(
            sqlx::query_scalar(include_str!("sql/try_advisory_xact_lock.sql"))
                .bind(key)
                .fetch_one(&mut **tx)
                .await?,
        )
    }

    /// Gives back the parked rows of the keys of `rows` (the replayed, discarded or purged
    /// dead letters: id, topic, key, and when the replayed one is due) that come before
    /// their key's next dead letter: at the replayed row's own time, so it still goes
    /// first, or now for a deleted one. In the replay's transaction. Topics and keys come
    /// as the bytes `convert_to(…, UTF8_BYTES)` read.
    pub(super) async fn unpark_keys(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        ids: &[i64],
        topics: &[Vec<u8>],
        keys: &[Vec<u8>],
        at_ms: &[i64],
    ) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let s = self.s();
        sqlx::query(AssertSqlSafe(format!(
            "WITH r AS (
               SELECT convert_from(topic, {UTF8_BYTES}) AS topic,
                      convert_from(key, {UTF8_BYTES}) AS key, min(id) AS id, min(at_ms) AS at_ms
               FROM unnest($1::bigint[], $2::bytea[], $3::bytea[], $4::bigint[]) AS x(id, topic, key, at_ms)
               GROUP BY topic, key),
             k AS (
               SELECT r.*, (SELECT min(d.id) FROM {s}.messages d
                            WHERE d.topic = r.topic AND md5(d.key) = md5(r.key)
                              AND d.key = r.key AND d.status = 3) AS next_dead
               FROM r)
             UPDATE {s}.messages m
             SET available_at = greatest(now(), now() + k.at_ms * interval '1 millisecond')
             FROM k
             WHERE m.topic = k.topic AND md5(m.key) = md5(k.key) AND m.key = k.key
               AND m.status = 0 AND m.available_at = '{PARKED_AT}' AND m.id > k.id
               AND (k.next_dead IS NULL OR m.id < k.next_dead)"
        )))
        .bind(ids)
        .bind(topics)
        .bind(keys)
        .bind(at_ms)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    pub(super) async fn park_held(&self, ordering: &KeyOrdering) -> Result<u64> {
        if !ordering.holds_dead() {
            return Ok(0);
        }
        let s = self.s();
        let mut tx = self.inner.pool.begin().await?;
        if !self.parking_lock(&mut tx, false).await? {
            return Ok(0);
        }
        // The dead letters are locked (one a replay or discard holds is skipped: it is
        // releasing its key): a replay that comes after waits for this transaction, then
        // gives the parked rows back itself.
        let parked = sqlx::query(AssertSqlSafe(format!(
            "WITH dead AS (
               SELECT topic, key, id FROM {s}.messages
               WHERE status = 3 AND key IS NOT NULL AND topic ~ ANY($1::text[])
               FOR SHARE SKIP LOCKED),
             blocked AS (SELECT topic, key, min(id) AS id FROM dead GROUP BY topic, key)
             UPDATE {s}.messages m SET available_at = '{PARKED_AT}'
             FROM blocked b
             WHERE m.topic = b.topic AND md5(m.key) = md5(b.key) AND m.key = b.key
               AND m.id > b.id AND m.key IS NOT NULL AND m.status <= 1
               AND m.claim_token IS NULL AND m.available_at <= now()"
        )))
        .bind(ordering.regexes())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(parked)
    }

    pub(super) async fn unpark_released(&self, ordering: &KeyOrdering) -> Result<u64> {
        let s = self.s();
        let mut tx = self.inner.pool.begin().await?;
        if !self.parking_lock(&mut tx, true).await? {
            return Ok(0);
        }
        let strict = ordering.holds_dead();
        let given = sqlx::query(AssertSqlSafe(format!(
            "WITH parked AS (
               SELECT topic, key, min(id) AS id FROM {s}.messages
               WHERE status = 0 AND available_at = '{PARKED_AT}'
               GROUP BY topic, key),
             free AS (
               SELECT p.topic, p.key FROM parked p
               WHERE NOT $2 OR p.key IS NULL OR NOT (p.topic ~ ANY($1::text[]))
                  OR NOT EXISTS (SELECT 1 FROM {s}.messages d
                                 WHERE d.topic = p.topic AND md5(d.key) = md5(p.key)
                                   AND d.key = p.key AND d.status = 3 AND d.id < p.id))
             UPDATE {s}.messages m SET available_at = now()
             FROM free f
             WHERE m.status = 0 AND m.available_at = '{PARKED_AT}'
               AND m.topic = f.topic AND m.key IS NOT DISTINCT FROM f.key"
        )))
        .bind(ordering.regexes())
        .bind(strict)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(given)
    }

    pub(super) async fn held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys> {
        if !ordering.is_on() {
            return Ok(HeldKeys::default());
        }
        let s = self.s();
        let (blocked_keys, held, oldest): (i64, i64, Option<i64>) =
            sqlx::query_as(AssertSqlSafe(format!(
                "WITH blocked AS (
                   SELECT topic, key, min(id) AS id FROM {s}.messages
                   WHERE status = 3 AND key IS NOT NULL AND topic ~ ANY($1::text[])
                   GROUP BY topic, key),
                 held AS (
                   SELECT m.occurred_at FROM blocked b JOIN {s}.messages m
                     ON m.topic = b.topic AND md5(m.key) = md5(b.key) AND m.key = b.key
                    AND m.status <> 2 AND m.status <= 1 AND m.id > b.id)
                 SELECT (SELECT count(*) FROM blocked), (SELECT count(*) FROM held),
                        (SELECT floor(extract(epoch FROM now() - min({OCCURRED_AT})))::bigint FROM held)"
            )))
            .bind(ordering.regexes())
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(HeldKeys {
            blocked_keys,
            held,
            oldest_held_age_seconds: oldest,
        })
    }

    pub(super) async fn due_held_by_order(&self, ordering: &KeyOrdering) -> Result<DueHeld> {
        let s = self.s();
        let not_dead = if ordering.skip_dead {
            " AND h.status <> 3"
        } else {
            ""
        };
        // The key's head is read as the ordered claim reads it (see `claim_ordered_sql`),
        // and only for the due rows of ordered keys.
        let (held, oldest_free): (i64, Option<i64>) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE held),
                    floor(extract(epoch FROM now() - min({AVAILABLE_AT}) FILTER (WHERE NOT held)))::bigint
             FROM (
               SELECT m.available_at,
                      coalesce(head.id <> m.id
                               AND (head.status = 3 OR head.available_at > now()
                                    OR head.locked_until > now()),
                               false) AS held
               FROM {s}.messages m
               LEFT JOIN LATERAL (
                 SELECT h.id, h.status, h.available_at, h.locked_until FROM {s}.messages h
                 WHERE m.key IS NOT NULL AND m.topic ~ ANY($1::text[])
                   AND h.topic = m.topic AND md5(h.key) = md5(m.key)
                   AND h.key IS NOT NULL AND h.status <> 2{not_dead}
                 ORDER BY h.topic, md5(h.key), h.id LIMIT 1) head ON true
               WHERE m.status <= 1 AND m.available_at <= now(){lease}) d",
            lease = crate::store::lease_free("m.", "now()")
        )))
        .bind(ordering.regexes())
        .fetch_one(&self.inner.pool)
        .await?;
        Ok(DueHeld {
            held,
            oldest_free_due_s: oldest_free.map(|s| s.max(0)),
        })
    }
}
