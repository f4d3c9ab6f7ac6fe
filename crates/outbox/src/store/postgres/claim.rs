//! The claim: its statements (unordered and per-key ordered), their parameters, and the
//! claim itself.

use super::PgStore;
use super::error::text_not_sendable;
use crate::error::Result;
use crate::store::{Claim, ClaimRequest, lease_free, millis};
use crate::topic::TopicPattern;
use sqlx::{AssertSqlSafe, Postgres, Row, SqlSafeStr, SqlStr};
use uuid::Uuid;

/// The positions of the claim's columns (see [`claim_update`]): arrays, one element per
/// claimed row, but the database's clock.
pub(super) mod col {
    pub(in crate::store::postgres) const ID: usize = 0;
    pub(in crate::store::postgres) const MESSAGE_ID: usize = 1;
    pub(in crate::store::postgres) const TOPIC: usize = 2;
    pub(in crate::store::postgres) const KEY: usize = 3;
    pub(in crate::store::postgres) const PAYLOAD: usize = 4;
    pub(in crate::store::postgres) const HEADERS: usize = 5;
    pub(in crate::store::postgres) const OCCURRED_EPOCH: usize = 6;
    pub(in crate::store::postgres) const ATTEMPTS: usize = 7;
    pub(in crate::store::postgres) const NOW_EPOCH: usize = 8;
}

/// About how many bytes of claimed rows one row of the claim's arrays holds (16 KiB; each
/// row counts its payload, topic, key and stored headers, plus 64 for the rest): the first
/// row past the bound starts the next chunk, so a chunk holds at least one row and stays far
/// below PostgreSQL's 1 GB limit on one value.
pub(super) const CLAIM_CHUNK_BYTES: i64 = 16 << 10;

/// The claim's filter of the topics not to claim, as `$5` (unordered claim) or `$6`
/// (ordered claim) holds their regexes.
pub(super) const SKIP_TOPICS_5: &str = " AND NOT (topic ~ ANY($5::text[]))";
/// See [`SKIP_TOPICS_5`].
pub(super) const SKIP_TOPICS_6: &str = " AND NOT (topic ~ ANY($6::text[]))";

/// The claim statement, with `extra` appended to the due-row filter and `update` (the
/// update of the rows and what it returns: [`claim_update`], or [`claim_update_ids`])
/// after it. The columns of [`claim_update`] are read by position ([`col`]): keep the two
/// in step. The claim honours
/// the pause switch and the topic pauses itself: the switch is one uncorrelated test (a
/// one-time filter), and the topic pauses are read row by row only when one exists (the
/// `NOT EXISTS` on the left of the `OR` is evaluated once, and `OR` stops at it); a
/// pause whose regex is not filled in yet holds every topic (fail closed) until `migrate`
/// fills it.
///
/// The claim's own transaction commits without waiting for its WAL to reach disk
/// (`synchronous_commit = off` for that transaction only, set once by an uncorrelated
/// subquery, so no other statement on the connection is affected): a claim lost in a
/// database crash leaves its rows as they were, to be claimed and published again (a
/// duplicate, never a loss), and the relay's settle finds its token gone and reports them
/// lost. Committed claims are visible to every other claim at once, so leases hold as
/// before. What it saves is one WAL flush between the producer's commit and the publish
/// (`-- latency`, PostgreSQL → JetStream at 1,000 msg/s on a machine with slow flushes:
/// p50 5.5–6.3 → 3.1–4.6 ms; see the user guide's benchmarks,
/// `docs/guide/src/benchmarks.md`). The ordered claim keeps synchronous commit:
/// a key's claim lost in a crash would let another relay publish the key's rows while the
/// first still does.
pub(super) fn claim_sql(s: &str, extra: &str, update: &str) -> String {
    format!(
        "WITH due AS (
           SELECT id FROM {s}.messages
           WHERE status <= 1 AND available_at <= now(){lease}{extra}{pauses}
             AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL
           ORDER BY available_at, id
           LIMIT $1
           FOR UPDATE SKIP LOCKED){update}",
        pauses = claim_pauses(s),
        lease = lease_free("", "now()"),
    )
}

/// The pause switch and the topic pauses, as the claim's filter.
pub(super) fn claim_pauses(s: &str) -> String {
    format!(
        "
             AND NOT EXISTS (SELECT 1 FROM {s}.control c WHERE c.id AND c.paused)
             AND (NOT EXISTS (SELECT 1 FROM {s}.topic_pauses)
                  OR NOT EXISTS (SELECT 1 FROM {s}.topic_pauses tp
                                 WHERE tp.regex IS NULL OR topic ~ tp.regex))"
    )
}

/// The claim's update of the rows of `due`, and what it returns: the claimed rows as
/// columns of arrays ([`col`]), in one row per [`CLAIM_CHUNK_BYTES`] of claimed rows, each
/// with the database's `now()`; empty headers come back as `NULL` (nothing to parse).
/// One row of arrays rather than a row per message: per
/// row, sqlx's row stream and row decoding were about a third of the relay's instructions
/// per message (callgrind, batch 1,000: 9,784 → 8,252 with this alone). The chunks stay
/// small because sqlx zero-fills its whole spare read buffer before every socket read: one
/// large row would be zeroed over and over while it arrives.
pub(super) fn claim_update(s: &str) -> String {
    format!(
        ",
         claimed AS (
           {set}
           RETURNING m.id, m.message_id, m.topic, m.key, m.payload, m.headers,
                     extract(epoch FROM m.occurred_at)::float8 AS occurred_epoch, m.attempts,
                     octet_length(m.payload) + pg_column_size(m.headers) + octet_length(m.topic)
                     + coalesce(octet_length(m.key), 0) + 64 AS bytes),
         chunked AS (
           SELECT *, sum(bytes) OVER (ORDER BY id) / {CLAIM_CHUNK_BYTES} AS chunk FROM claimed)
         SELECT array_agg(id), array_agg(message_id), array_agg(topic), array_agg(key),
                array_agg(payload), array_agg(nullif(headers, '{{}}')), array_agg(occurred_epoch),
                array_agg(attempts), extract(epoch FROM now())::float8
         FROM chunked GROUP BY chunk",
        set = claim_set(s),
    )
}

/// The claim's update of the rows of `due` (`$2` the relay, `$3` the token, `$4` the
/// lease in ms), without its `RETURNING`.
///
/// It writes only columns no index reads (`attempts`, `claimed_by`, `claim_token`,
/// `locked_until`): a claimed row keeps `status` 0 and its `available_at`, and is claimed
/// because it holds a token ([`CLAIMED_SQL`](crate::store::CLAIMED_SQL)) under a live lease ([`lease_free`](crate::store::lease_free)). So
/// PostgreSQL updates it as a heap-only tuple (HOT) on its own page, with no index entry
/// at all, where changing `status` or `available_at` inserted the row again into the
/// primary key, the message-id index, the live index and the per-key index (an `md5` of
/// the key for every keyed row). The table's fillfactor (50, migration 10) keeps room on
/// each page for one new version of every row. Claim + mark of 1,000 ~300-byte keyed rows
/// right after a checkpoint: about 2,300 → 1,000 WAL bytes per message (the
/// table-path benchmark prints the figures). Rows stored with `status` 1 (claimed before
/// migration 10) are read the same way: live, and claimed while they hold a token.
pub(super) fn claim_set(s: &str) -> String {
    format!(
        "UPDATE {s}.messages m
           SET attempts = least(m.attempts, 2147483646) + 1, claimed_by = $2, claim_token = $3,
               locked_until = now() + $4 * interval '1 millisecond'
           FROM due WHERE m.id = due.id"
    )
}

/// As [`claim_update`], returning only the claimed ids (one array, in one row, with the
/// database's `now()` after it, or no row when nothing was claimed): the claim of
/// [`PgStore::claim_then_read`], which no row's text can fail.
pub(super) fn claim_update_ids(s: &str) -> String {
    format!(
        ",
         claimed AS ({set} RETURNING m.id)
         SELECT array_agg(id), extract(epoch FROM now())::float8 FROM claimed HAVING count(*) > 0",
        set = claim_set(s),
    )
}

/// The claim with per-key ordering ([`KeyOrdering`](crate::store::KeyOrdering)): `$5` holds the ordered topics'
/// regexes, `extra` may use `$6`.
///
/// 1. `cand`: the due rows, as the unordered claim takes them, less the rows of an ordered
///    key whose first row not dispatched (the key's head, by the `messages_key` index)
///    comes after them in the claim's order (`available_at, id`) or holds a live lease:
///    claimed, waiting for a retry, or given back later than they were written; and less
///    those whose head is dead when dead rows hold their key. So a blocked key never fills
///    the claim, and a row taken here has its key's head before it: the head is taken too
///    (or locked by another claim), and every key makes progress.
///    Each row keeps its key's head (`head_id`). The head is read by a `LATERAL` join whose
///    verdict is one boolean column (`head_ok`): with the comparisons in the outer `WHERE`
///    instead, the planner multiplies their selectivities, expects almost no row to pass,
///    and sorts the whole table rather than walk the live index up to the limit (measured:
///    330 ms instead of 20 ms for 1,000 rows of 20,000).
/// 2. `fence`: per ordered key of `cand` with more than one row there, its head among them,
///    the key's first row that blocks it and is not in `cand`: live (pending, claimed,
///    locked by another claim and so skipped), or dead when dead rows hold. That row was
///    cut off by the limit, skipped, or is not ready. A key with one row in `cand` needs no
///    fence (its row is due exactly when it is the head), nor does a key whose head is not
///    in `cand` (the head is its fence, and comes first): with many keys, most claimed rows
///    cost one index read, not two (a claim of 1,000 rows over 1,000 keys: 31 → 20 ms).
/// 3. `due`: the rows of `cand` before their key's fence; the rest stay as they were
///    (locked until this statement ends, then free).
///
/// Both per-key reads are equalities on the `messages_key` index's leading columns
/// (`topic`, `md5(key)`) ordered as the index is: the index scan starts at the key's first
/// entry and stops after its last. (A row comparison `(topic, md5(key), id) >= …` as the
/// only condition also started there, but nothing stopped it: PostgreSQL checks every
/// later entry of the index page; the head reads of a claim of 1,000 rows over 1,000 keys
/// took about 25 ms that way, 18 ms this way. With `key = …` and `ORDER BY id` instead, the planner,
/// seeing one hot key hold most rows, walked the primary key from the first id and passed
/// every dispatched row of the key on each probe, a claim quadratic in the key's history:
/// 20,000 rows of one key took 139 s instead of 7 s.) A head found is the key's when its
/// `key` equals the row's: two keys of one topic with the same hash only hold each other
/// back.
///
/// Whatever this statement's snapshot misses only makes it more careful: a row it sees
/// live may since have been dispatched (the key waits one claim longer), never the other
/// way round, since a dispatched row stays dispatched.
pub(super) fn claim_ordered_sql(s: &str, extra: &str, skip_dead: bool, update: &str) -> String {
    let not_dead = if skip_dead { " AND h.status <> 3" } else { "" };
    let not_dead_e = if skip_dead { " AND e.status <> 3" } else { "" };
    format!(
        "WITH cand AS MATERIALIZED (
           SELECT m.id, m.topic, m.key, head_id IS NOT NULL AS ord, head_id
           FROM {s}.messages m
           LEFT JOIN LATERAL (
             SELECT h.id AS head_id,
                    h.key = m.key AND h.status <> 3 AND h.available_at <= m.available_at
                      AND coalesce(h.locked_until <= now(), true) AS head_ok
             FROM {s}.messages h
             WHERE m.key IS NOT NULL AND m.topic ~ ANY($5::text[])
               AND h.topic = m.topic AND md5(h.key) = md5(m.key)
               AND h.key IS NOT NULL AND h.status <> 2{not_dead}
             ORDER BY h.topic, md5(h.key), h.id LIMIT 1) head ON true
           WHERE m.status <= 1 AND m.available_at <= now(){lease}{extra}{pauses}
             AND coalesce(head_ok, true)
           ORDER BY m.available_at, m.id
           LIMIT $1
           FOR UPDATE OF m SKIP LOCKED),
         fence AS MATERIALIZED (
           SELECT k.topic, k.key,
                  (SELECT e.id
                   FROM {s}.messages e
                   WHERE e.topic = k.topic AND md5(e.key) = md5(k.key)
                     AND e.key IS NOT NULL AND e.status <> 2{not_dead_e}
                     AND e.id NOT IN (SELECT id FROM cand)
                   ORDER BY e.topic, md5(e.key), e.id LIMIT 1) AS fence_id
           FROM (SELECT topic, key FROM cand WHERE ord
                 GROUP BY topic, key HAVING count(*) > 1 AND bool_or(head_id = id)) k),
         due AS (
           SELECT c.id FROM cand c LEFT JOIN fence f ON f.topic = c.topic AND f.key = c.key
           WHERE NOT c.ord
              OR (f.topic IS NULL AND c.head_id = c.id)
              OR (f.topic IS NOT NULL AND (f.fence_id IS NULL OR c.id < f.fence_id))){update}",
        pauses = claim_pauses(s),
        lease = lease_free("m.", "now()"),
    )
}

/// Binds the claim statement's parameters: `$1` the batch size, `$2` the relay, `$3` the
/// token, `$4` the lease in ms, then the ordered topics' regexes and the topics to skip,
/// each when there are any.
pub(super) fn bind_claim<'q>(
    query: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    req: &'q ClaimRequest,
    token: Uuid,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    let mut query = query
        .persistent(false)
        .bind(i64::from(req.batch_size))
        .bind(&req.relay_id)
        .bind(token)
        .bind(millis(req.lease));
    if req.ordering.is_on() {
        query = query.bind(req.ordering.regexes());
    }
    if !req.skip_topics.is_empty() {
        query = query.bind(
            req.skip_topics
                .iter()
                .map(TopicPattern::regex)
                .collect::<Vec<_>>(),
        );
    }
    query
}

impl PgStore {
    /// The claim statement for `req` (see [`claim_sql`], [`claim_ordered_sql`]).
    pub(super) fn claim_statement(&self, req: &ClaimRequest) -> SqlStr {
        let skip_dead = req.ordering.skip_dead;
        match (req.ordering.is_on(), req.skip_topics.is_empty()) {
            (false, true) => self.inner.sql.claim.clone(),
            (false, false) => self.inner.sql.claim_skip.clone(),
            (true, true) if skip_dead => self.inner.sql.claim_ordered_skip_dead.clone(),
            (true, true) => self.inner.sql.claim_ordered.clone(),
            (true, false) => {
                AssertSqlSafe(self.claim_text(req, &claim_update(self.s()))).into_sql_str()
            }
        }
    }

    /// The claim statement of `req` with `update` after its due rows (see [`claim_sql`]).
    pub(super) fn claim_text(&self, req: &ClaimRequest, update: &str) -> String {
        let s = self.s();
        let skip_dead = req.ordering.skip_dead;
        match (req.ordering.is_on(), req.skip_topics.is_empty()) {
            (false, true) => claim_sql(s, "", update),
            (false, false) => claim_sql(s, SKIP_TOPICS_5, update),
            (true, true) => claim_ordered_sql(s, "", skip_dead, update),
            (true, false) => claim_ordered_sql(s, SKIP_TOPICS_6, skip_dead, update),
        }
    }

    /// The plan PostgreSQL chooses for the claim statement of `req`, as `EXPLAIN` prints
    /// it (the statement is planned with `req`'s values, not run): which indexes a claim
    /// reads, for tests and for operators checking a large table.
    ///
    /// # Errors
    /// Database errors.
    pub async fn explain_claim(&self, req: &ClaimRequest) -> Result<String> {
        let sql = format!("EXPLAIN {}", self.claim_statement(req).as_str());
        let query = bind_claim(sqlx::query(AssertSqlSafe(sql)), req, Uuid::nil());
        let rows = query.persistent(false).fetch_all(&self.inner.pool).await?;
        let lines: Vec<String> = rows
            .iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<std::result::Result<_, _>>()?;
        Ok(lines.join("\n"))
    }

    pub(super) async fn claim(&self, req: &ClaimRequest) -> Result<Claim> {
        let token = Uuid::now_v7();
        // Not a named prepared statement: PostgreSQL plans an unnamed statement with the
        // actual parameters every time, so the claim never falls back to a generic plan
        // (which collapsed throughput under concurrent inserts when measured).
        let query = bind_claim(sqlx::query(self.claim_statement(req)), req, token);
        let rows = match query.fetch_all(&self.inner.pool).await {
            Ok(rows) => rows,
            // A row's text the server cannot send: the statement failed whole (nothing
            // claimed), and would fail again on every claim.
            Err(e) if text_not_sendable(&e) => return self.claim_then_read(req, token).await,
            Err(e) => return Err(e.into()),
        };
        let mut claim = Claim {
            token,
            messages: Vec::new(),
            malformed: Vec::new(),
            db_now: None,
        };
        for row in &rows {
            if let Err(ids) = Self::chunk_into(row, &mut claim) {
                let one_by_one = self.read_claimed(token, &ids).await?;
                claim.messages.extend(one_by_one.messages);
                claim.malformed.extend(one_by_one.malformed);
            }
        }
        claim.messages.sort_by_key(|m| m.id);
        claim.db_now = rows
            .first()
            .and_then(|r| r.try_get::<f64, _>(col::NOW_EPOCH).ok())
            .and_then(crate::store::epoch_secs_to_time);
        Ok(claim)
    }
}
