//! PostgreSQL store: schema `outbox` (configurable), claims with `FOR UPDATE SKIP LOCKED`,
//! wake-up by `LISTEN/NOTIFY` with a poll underneath.
//!
//! Supported: PostgreSQL 13 and later (`gen_random_uuid()` in core).

use super::ops::{self, Dialect};
use super::seam::{Maintenance, Operations, Registry, Relaying, Views};
use super::{
    Claim, ClaimRequest, ClaimsBy, Counts, Dead, DeadLetter, DeadSelector, DueHeld, HeldKeys,
    KeyOrdering, Leases, Overview, PARKED_AT, PauseState, PurgeBatch, RelayHeartbeat, RelayRecord,
    ReplayAction, ReplayOutcome, ReplayRecord, ReplayRequest, Settled, Settlement, StoreConfig,
    TopicPause, millis, parse_headers,
};
use crate::error::{Error, Result};
use crate::inbox::Accepted;
use crate::message::{Enqueued, Message, OutgoingMessage};
use crate::sink::router::TopicPattern;
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row, SqlSafeStr, SqlStr, Transaction};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use uuid::Uuid;

/// Schema version this build creates and expects (4: the consumer inbox; 5: `enqueue(...)`
/// skips its header checks for a message without headers; 6: topic pauses carry their
/// regex, so the claim itself honours them; 7: the `messages_key` index of per-key
/// ordering).
pub const SCHEMA_VERSION: i64 = 9;

/// SQL text built once per store from the validated schema name.
struct Sql {
    enqueue: SqlStr,
    claim: SqlStr,
    claim_skip: SqlStr,
    claim_ordered: SqlStr,
    claim_ordered_skip_dead: SqlStr,
    settle: SqlStr,
    mark: SqlStr,
    renew: SqlStr,
    pause_state: SqlStr,
    set_pause: SqlStr,
    counts: SqlStr,
    version: SqlStr,
    purge: SqlStr,
    leases: SqlStr,
    inbox_accept: SqlStr,
    inbox_purge: SqlStr,
}

impl Sql {
    fn new(s: &str) -> Self {
        let q = |text: String| AssertSqlSafe(text).into_sql_str();
        Sql {
            enqueue: q(format!(
                "INSERT INTO {s}.messages (message_id, topic, key, payload, headers, available_at)
                 VALUES ($1, $2, $3, $4, $5, coalesce($6, now() + $7 * interval '1 millisecond'))
                 ON CONFLICT (message_id) DO NOTHING RETURNING id"
            )),
            claim: q(claim_sql(s, "", &claim_update(s))),
            // Extra topics not to claim: $5 is an array of topic regexes.
            claim_skip: q(claim_sql(s, SKIP_TOPICS_5, &claim_update(s))),
            claim_ordered: q(claim_ordered_sql(s, "", false, &claim_update(s))),
            claim_ordered_skip_dead: q(claim_ordered_sql(s, "", true, &claim_update(s))),
            // One statement for a claim's whole outcome (River's
            // `JobSetStateIfRunningMany`), one data-modifying CTE per kind so each keeps
            // the plan the separate statements had: the marks and releases by
            // `id = ANY(..)` on the primary key, the (few) retries and quarantines joined
            // from their arrays. Every row changes only while this claim holds it. (A
            // single UPDATE joined to one unnest of every outcome planned badly at 1,000
            // rows: measured 0.25 x the four separate statements.) The changed ids come
            // back as one array, not a row each: per row, sqlx's row stream cost the
            // relay more instructions than the statement's whole round trip.
            settle: q(format!(
                "WITH d AS (
                   UPDATE {s}.messages
                   SET status = 2, dispatched_at = now(), locked_until = NULL, claim_token = NULL,
                       last_error = NULL
                   WHERE id = ANY($1) AND claim_token = $9 AND status = 1
                   RETURNING id),
                 r AS (
                   UPDATE {s}.messages m
                   SET status = 0, available_at = now() + x.delay_ms * interval '1 millisecond',
                       last_error = x.err, locked_until = NULL, claim_token = NULL,
                       attempts = CASE WHEN x.refund THEN greatest(m.attempts - 1, 0) ELSE m.attempts END
                   FROM unnest($2::bigint[], $3::bigint[], $4::text[], $5::bool[])
                        AS x(id, delay_ms, err, refund)
                   WHERE m.id = x.id AND m.claim_token = $9 AND m.status = 1
                   RETURNING m.id),
                 q AS (
                   UPDATE {s}.messages m
                   SET status = 3, last_error = x.err, locked_until = NULL, claim_token = NULL,
                       available_at = now()
                   FROM unnest($6::bigint[], $7::text[]) AS x(id, err)
                   WHERE m.id = x.id AND m.claim_token = $9 AND m.status = 1
                   RETURNING m.id),
                 l AS (
                   UPDATE {s}.messages
                   SET status = 0, attempts = greatest(attempts - 1, 0), available_at = now(),
                       locked_until = NULL, claim_token = NULL
                   WHERE id = ANY($8) AND claim_token = $9 AND status = 1
                   RETURNING id)
                 SELECT coalesce(array_agg(id), '{{}}') FROM (
                   SELECT id FROM d UNION ALL SELECT id FROM r
                   UNION ALL SELECT id FROM q UNION ALL SELECT id FROM l) changed"
            )),
            // The common case, a batch the sink confirmed whole: the plain mark by
            // primary key (no unnest to plan).
            mark: q(format!(
                "WITH d AS (
                   UPDATE {s}.messages
                   SET status = 2, dispatched_at = now(), locked_until = NULL, claim_token = NULL,
                       last_error = NULL
                   WHERE id = ANY($1) AND claim_token = $2 AND status = 1
                   RETURNING id)
                 SELECT coalesce(array_agg(id), '{{}}') FROM d"
            )),
            renew: q(format!(
                "WITH r AS (
                   UPDATE {s}.messages
                   SET locked_until = now() + $2 * interval '1 millisecond',
                       available_at = now() + $2 * interval '1 millisecond'
                   WHERE id = ANY($3) AND claim_token = $1 AND status = 1
                   RETURNING id)
                 SELECT coalesce(array_agg(id), '{{}}') FROM r"
            )),
            pause_state: q(format!(
                "SELECT c.paused, c.reason, c.changed_at,
                        coalesce((SELECT json_agg(json_build_array(pattern, reason, paused_by,
                                                  floor(extract(epoch FROM paused_at) * 1000)::bigint)
                                                  ORDER BY pattern)
                                  FROM {s}.topic_pauses), '[]')::text
                 FROM {s}.control c WHERE c.id"
            )),
            set_pause: q(format!(
                "UPDATE {s}.control SET paused = $1, reason = $2, changed_at = now() WHERE id"
            )),
            counts: q(format!(
                "SELECT count(*) FILTER (WHERE status = 0),
                        count(*) FILTER (WHERE status = 1),
                        count(*) FILTER (WHERE status = 2),
                        count(*) FILTER (WHERE status = 3),
                        floor(extract(epoch FROM now() - min({OCCURRED_AT}) FILTER (WHERE status = 0)))::bigint
                 FROM {s}.messages"
            )),
            version: q(format!(
                "SELECT coalesce(max(version), 0) FROM {s}.schema_migrations"
            )),
            purge: q(format!(
                "DELETE FROM {s}.messages WHERE id IN (
                   SELECT id FROM {s}.messages
                   WHERE status = 2 AND dispatched_at < now() - $1 * interval '1 millisecond'
                   ORDER BY id LIMIT $2
                   FOR UPDATE SKIP LOCKED)"
            )),
            // On a claimed row available_at is the lease end (the live index serves it).
            leases: q(format!(
                "SELECT count(*), max(available_at),
                        ceil(extract(epoch FROM max(available_at) - now()) * 1000)::bigint
                 FROM {s}.messages WHERE status = 1 AND available_at > now()"
            )),
            // Insert first: a duplicate waits for a concurrent accept to end and then does
            // nothing (no unique-violation exception, so the caller's transaction lives).
            inbox_accept: q(format!(
                "INSERT INTO {s}.inbox (consumer, message_id) VALUES ($1, $2)
                 ON CONFLICT (consumer, message_id) DO NOTHING"
            )),
            // Oldest first over the received_at index; rows a concurrent purger (or a
            // consumer's accept) holds are skipped, not waited for.
            inbox_purge: q(format!(
                "DELETE FROM {s}.inbox WHERE (consumer, message_id) IN (
                   SELECT consumer, message_id FROM {s}.inbox
                   WHERE received_at < now() - $1 * interval '1 millisecond'
                   ORDER BY received_at LIMIT $2
                   FOR UPDATE SKIP LOCKED)"
            )),
        }
    }
}

/// The positions of the claim's columns (see [`claim_update`]): arrays, one element per
/// claimed row, but the database's clock.
mod col {
    pub(super) const ID: usize = 0;
    pub(super) const MESSAGE_ID: usize = 1;
    pub(super) const TOPIC: usize = 2;
    pub(super) const KEY: usize = 3;
    pub(super) const PAYLOAD: usize = 4;
    pub(super) const HEADERS: usize = 5;
    pub(super) const OCCURRED_EPOCH: usize = 6;
    pub(super) const ATTEMPTS: usize = 7;
    pub(super) const NOW_EPOCH: usize = 8;
}

/// About how many bytes of claimed rows one row of the claim's arrays holds (16 KiB; each
/// row counts its payload, topic, key and stored headers, plus 64 for the rest): the first
/// row past the bound starts the next chunk, so a chunk holds at least one row and stays far
/// below PostgreSQL's 1 GB limit on one value.
const CLAIM_CHUNK_BYTES: i64 = 16 << 10;

/// The claim's filter of the topics not to claim, as `$5` (unordered claim) or `$6`
/// (ordered claim) holds their regexes.
const SKIP_TOPICS_5: &str = " AND NOT (topic ~ ANY($5::text[]))";
/// See [`SKIP_TOPICS_5`].
const SKIP_TOPICS_6: &str = " AND NOT (topic ~ ANY($6::text[]))";

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
fn claim_sql(s: &str, extra: &str, update: &str) -> String {
    format!(
        "WITH due AS (
           SELECT id FROM {s}.messages
           WHERE status <= 1 AND available_at <= now(){extra}{pauses}
             AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL
           ORDER BY available_at, id
           LIMIT $1
           FOR UPDATE SKIP LOCKED){update}",
        pauses = claim_pauses(s),
    )
}

/// The pause switch and the topic pauses, as the claim's filter.
fn claim_pauses(s: &str) -> String {
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
fn claim_update(s: &str) -> String {
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
fn claim_set(s: &str) -> String {
    format!(
        "UPDATE {s}.messages m
           SET status = 1, attempts = least(m.attempts, 2147483646) + 1, claimed_by = $2, claim_token = $3,
               locked_until = now() + $4 * interval '1 millisecond',
               available_at = now() + $4 * interval '1 millisecond'
           FROM due WHERE m.id = due.id"
    )
}

/// As [`claim_update`], returning only the claimed ids (one array, in one row, with the
/// database's `now()` after it, or no row when nothing was claimed): the claim of
/// [`PgStore::claim_then_read`], which no row's text can fail.
fn claim_update_ids(s: &str) -> String {
    format!(
        ",
         claimed AS ({set} RETURNING m.id)
         SELECT array_agg(id), extract(epoch FROM now())::float8 FROM claimed HAVING count(*) > 0",
        set = claim_set(s),
    )
}

/// The claim with per-key ordering ([`KeyOrdering`](super::KeyOrdering)): `$5` holds the ordered topics'
/// regexes, `extra` may use `$6`.
///
/// 1. `cand`: the due rows, as the unordered claim takes them, less the rows of an ordered
///    key whose first row not dispatched (the key's head, by the `messages_key` index)
///    comes after them in the claim's order (`available_at, id`): claimed under a live
///    lease, waiting for a retry, or given back later than they were written; and less
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
fn claim_ordered_sql(s: &str, extra: &str, skip_dead: bool, update: &str) -> String {
    let not_dead = if skip_dead { " AND h.status <> 3" } else { "" };
    let not_dead_e = if skip_dead { " AND e.status <> 3" } else { "" };
    format!(
        "WITH cand AS MATERIALIZED (
           SELECT m.id, m.topic, m.key, head_id IS NOT NULL AS ord, head_id
           FROM {s}.messages m
           LEFT JOIN LATERAL (
             SELECT h.id AS head_id,
                    h.key = m.key AND h.status <> 3 AND h.available_at <= m.available_at AS head_ok
             FROM {s}.messages h
             WHERE m.key IS NOT NULL AND m.topic ~ ANY($5::text[])
               AND h.topic = m.topic AND md5(h.key) = md5(m.key)
               AND h.key IS NOT NULL AND h.status <> 2{not_dead}
             ORDER BY h.topic, md5(h.key), h.id LIMIT 1) head ON true
           WHERE m.status <= 1 AND m.available_at <= now(){extra}{pauses}
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
    )
}

/// Binds the claim statement's parameters: `$1` the batch size, `$2` the relay, `$3` the
/// token, `$4` the lease in ms, then the ordered topics' regexes and the topics to skip,
/// each when there are any.
fn bind_claim<'q>(
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

/// The migrations, in order; each is applied once, in its own transaction.
/// The `enqueue(...)` SQL function, as the latest migration defines it (v1 creates it,
/// later versions replace it).
fn enqueue_function(s: &str) -> String {
    format!(
        r#"
-- Enqueue from any language, inside the caller's transaction. Idempotent on message_id:
-- a duplicate returns the existing row's id and does not abort the transaction.
CREATE OR REPLACE FUNCTION {s}.enqueue(
    topic text,
    payload bytea,
    key text DEFAULT NULL,
    message_id uuid DEFAULT NULL,
    headers jsonb DEFAULT '{{}}',
    available_at timestamptz DEFAULT NULL
) RETURNS bigint LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    mid uuid := coalesce(enqueue.message_id, {s}.uuid_v7());
    hdr jsonb := coalesce(enqueue.headers, '{{}}'::jsonb);
    lim integer;
    size bigint;
    hsize bigint := 0;
    new_id bigint;
BEGIN
    IF enqueue.topic IS NULL OR enqueue.topic = '' OR octet_length(enqueue.topic) > 255
       OR enqueue.topic ~ '[[:space:][:cntrl:]*>]' THEN
        RAISE EXCEPTION '{s}.enqueue: topic must be 1-255 bytes without whitespace, control characters or wildcards (* >), got %', quote_nullable(enqueue.topic)
            USING ERRCODE = '22023';
    END IF;
    IF enqueue.payload IS NULL THEN
        RAISE EXCEPTION '{s}.enqueue: payload must not be NULL (use an empty bytea)' USING ERRCODE = '22023';
    END IF;
    -- The header checks and their size only when there are headers (most messages have
    -- none): three subqueries over an empty object, otherwise run on every call.
    IF hdr <> '{{}}'::jsonb THEN
        IF jsonb_typeof(hdr) <> 'object'
           OR EXISTS (SELECT 1 FROM jsonb_each(hdr) h WHERE jsonb_typeof(h.value) <> 'string') THEN
            RAISE EXCEPTION '{s}.enqueue: headers must be a JSON object of strings' USING ERRCODE = '22023';
        END IF;
        IF EXISTS (SELECT 1 FROM jsonb_object_keys(hdr) k
                   WHERE k !~ '^[A-Za-z0-9!#$%&''*+.^_`|~-]{{1,255}}$') THEN
            RAISE EXCEPTION '{s}.enqueue: header names must be 1-255 characters of A-Z a-z 0-9 and !#$%%&''*+-.^_`|~'
                USING ERRCODE = '22023';
        END IF;
        IF hdr ?| ARRAY['message-id', 'topic', 'key', 'occurred-at'] THEN
            RAISE EXCEPTION '{s}.enqueue: headers message-id, topic, key and occurred-at are reserved (they come from the message itself)'
                USING ERRCODE = '22023';
        END IF;
        hsize := coalesce((SELECT sum(octet_length(h.key) + octet_length(h.value))
                           FROM jsonb_each_text(hdr) h), 0);
    END IF;
    SELECT c.max_message_bytes INTO lim FROM {s}.control c WHERE c.id;
    size := octet_length(enqueue.payload) + octet_length(enqueue.topic)
          + coalesce(octet_length(enqueue.key), 0) + hsize;
    IF size > lim THEN
        RAISE EXCEPTION '{s}.enqueue: message too large: % bytes exceed the limit of % bytes', size, lim
            USING ERRCODE = '54000';
    END IF;
    INSERT INTO {s}.messages AS m (message_id, topic, key, payload, headers, available_at)
    VALUES (mid, enqueue.topic, enqueue.key, enqueue.payload, hdr, coalesce(enqueue.available_at, now()))
    ON CONFLICT (message_id) DO NOTHING
    RETURNING m.id INTO new_id;
    IF new_id IS NULL THEN
        SELECT m.id INTO new_id FROM {s}.messages m WHERE m.message_id = mid;
    END IF;
    RETURN new_id;
END
$fn$;
"#
    )
}

fn migrations(s: &str) -> Vec<String> {
    vec![
        format!(
            r#"
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.messages (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    uuid NOT NULL UNIQUE,
    topic         text NOT NULL CHECK (topic <> ''),
    key           text,
    payload       bytea NOT NULL,
    headers       jsonb NOT NULL DEFAULT '{{}}' CHECK (jsonb_typeof(headers) = 'object'),
    occurred_at   timestamptz NOT NULL DEFAULT now(),
    available_at  timestamptz NOT NULL DEFAULT now(),
    status        smallint NOT NULL DEFAULT 0 CHECK (status BETWEEN 0 AND 3),
    attempts      integer NOT NULL DEFAULT 0,
    claimed_by    text,
    claim_token   uuid,
    locked_until  timestamptz,
    dispatched_at timestamptz,
    last_error    text
);
-- The claim path: only live rows (pending or claimed), in the order the claim reads them.
CREATE INDEX IF NOT EXISTS messages_live ON {s}.messages (available_at, id) WHERE status <= 1;

CREATE TABLE IF NOT EXISTS {s}.control (
    id                boolean PRIMARY KEY DEFAULT true CHECK (id),
    paused            boolean NOT NULL DEFAULT false,
    reason            text,
    changed_at        timestamptz NOT NULL DEFAULT now(),
    max_message_bytes integer NOT NULL DEFAULT 4194304
);
INSERT INTO {s}.control (id) VALUES (true) ON CONFLICT DO NOTHING;

-- UUIDv7 (RFC 9562 section 5.7): 48-bit Unix time in ms, version 7, random rest.
CREATE OR REPLACE FUNCTION {s}.uuid_v7() RETURNS uuid LANGUAGE sql VOLATILE AS $fn$
  SELECT encode(
    set_bit(set_bit(
      overlay(uuid_send(gen_random_uuid())
              PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
              FROM 1 FOR 6),
      52, 1), 53, 1),
    'hex')::uuid
$fn$;

{enqueue_fn}
-- Wake relays at once: one notification per inserting statement (not per row).
CREATE OR REPLACE FUNCTION {s}.notify_relays() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify('{s}_messages', '');
    RETURN NULL;
END
$fn$;
DROP TRIGGER IF EXISTS messages_notify ON {s}.messages;
CREATE TRIGGER messages_notify AFTER INSERT ON {s}.messages
    FOR EACH STATEMENT EXECUTE FUNCTION {s}.notify_relays();
"#,
            enqueue_fn = enqueue_function(s)
        ),
        format!(
            r#"
-- Retention: the purge reads dispatched rows by age only.
CREATE INDEX IF NOT EXISTS messages_dispatched ON {s}.messages (dispatched_at) WHERE status = 2;
"#
        ),
        format!(
            r#"
-- Operations: dead letters by when they died (available_at), audited replays, the relay
-- registry, topic pauses.
CREATE INDEX IF NOT EXISTS messages_dead ON {s}.messages (available_at, id) WHERE status = 3;
ALTER TABLE {s}.messages ADD COLUMN IF NOT EXISTS replay_id bigint;
CREATE TABLE IF NOT EXISTS {s}.replays (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at           timestamptz NOT NULL DEFAULT now(),
    requested_by text NOT NULL,
    reason       text NOT NULL,
    action       text NOT NULL,
    selection    text NOT NULL,
    count        bigint NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS {s}.relays (
    relay_id      text PRIMARY KEY,
    host          text NOT NULL,
    pid           bigint NOT NULL,
    version       text NOT NULL,
    sink          text NOT NULL,
    in_flight     bigint NOT NULL DEFAULT 0,
    started_at    timestamptz NOT NULL DEFAULT now(),
    last_seen     timestamptz NOT NULL DEFAULT now(),
    last_claim_at timestamptz
);
CREATE TABLE IF NOT EXISTS {s}.topic_pauses (
    pattern   text PRIMARY KEY,
    reason    text NOT NULL,
    paused_by text NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT now()
);
"#
        ),
        format!(
            r#"
-- The consumer inbox: one row per (consumer, message id) a consumer accepted, written in
-- the consumer's own transaction; the purge reads it by age.
CREATE TABLE IF NOT EXISTS {s}.inbox (
    consumer    text NOT NULL CHECK (consumer <> '' AND octet_length(consumer) <= 255),
    message_id  uuid NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS inbox_received ON {s}.inbox (received_at);

-- Accept from any language, inside the consumer's transaction: true the first time this
-- consumer sees message_id, false for a duplicate. Insert first under the primary key; a
-- duplicate raises nothing, so the transaction stays usable.
CREATE OR REPLACE FUNCTION {s}.inbox_accept(consumer text, message_id uuid)
RETURNS boolean LANGUAGE plpgsql AS $fn$
DECLARE
    n bigint;
BEGIN
    IF inbox_accept.consumer IS NULL OR inbox_accept.consumer = ''
       OR octet_length(inbox_accept.consumer) > 255 OR inbox_accept.consumer ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION '{s}.inbox_accept: consumer must be 1-255 bytes without control characters, got %', quote_nullable(inbox_accept.consumer)
            USING ERRCODE = '22023';
    END IF;
    IF inbox_accept.message_id IS NULL THEN
        RAISE EXCEPTION '{s}.inbox_accept: message_id must not be NULL' USING ERRCODE = '22023';
    END IF;
    INSERT INTO {s}.inbox AS i (consumer, message_id)
    VALUES (inbox_accept.consumer, inbox_accept.message_id)
    ON CONFLICT ON CONSTRAINT inbox_pkey DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n > 0;
END
$fn$;
"#
        ),
        // v5: enqueue() skips the header checks for a message without headers.
        enqueue_function(s),
        // v6: a topic pause carries its pattern's regex (`TopicPattern::regex`), so the
        // claim matches topics against it; `migrate` fills it for pauses made before.
        format!("ALTER TABLE {s}.topic_pauses ADD COLUMN IF NOT EXISTS regex text;"),
        // v7: per-key ordering reads a key's rows that are not dispatched, in id order.
        // By md5(key): a key of any length fits the index (a btree entry is at most 2704
        // bytes); two keys of one topic with the same hash only hold each other back.
        format!(
            "CREATE INDEX IF NOT EXISTS messages_key ON {s}.messages (topic, md5(key), id)
             WHERE key IS NOT NULL AND status <> 2;"
        ),
        // v8: the registry keeps each relay's destinations and their state (JSON).
        format!("ALTER TABLE {s}.relays ADD COLUMN IF NOT EXISTS destinations text;"),
        // v9: a registry row per relay instance (two relays under one id each keep
        // theirs), with the instance's lease (which claims are whose).
        format!(
            "ALTER TABLE {s}.relays ADD COLUMN IF NOT EXISTS instance text NOT NULL DEFAULT '';
             ALTER TABLE {s}.relays ADD COLUMN IF NOT EXISTS lease_ms bigint NOT NULL DEFAULT 0;
             ALTER TABLE {s}.relays DROP CONSTRAINT IF EXISTS relays_pkey;
             ALTER TABLE {s}.relays ADD PRIMARY KEY (relay_id, instance);"
        ),
    ]
}

struct Inner {
    pool: PgPool,
    config: StoreConfig,
    sql: Sql,
    url: Option<String>,
    wakeup: super::Wakeup,
}

/// The PostgreSQL store. Cheap to clone (an `Arc` inside).
///
/// ```no_run
/// # async fn f() -> Result<(), outbox::Error> {
/// use outbox::{Message, postgres::PgStore, StoreConfig};
/// let store = PgStore::connect("postgres://localhost/app", StoreConfig::default()).await?;
/// let mut tx = store.pool().begin().await?;
/// // ... the business change on &mut *tx ...
/// store.enqueue(&mut tx, &Message::new("orders.order-placed.v1", b"{}".to_vec())).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

impl PgStore {
    /// Connects a pool of its own to `url` (the relay's connections).
    ///
    /// TLS follows the URL (sqlx's parameters, named as libpq's): `sslmode=disable`,
    /// `prefer` (the default: TLS when the server offers it, its certificate not checked),
    /// `require` (TLS, not checked), `verify-ca` (the chain) or `verify-full` (the chain and
    /// the host name); `sslrootcert=PATH` adds CAs to the system's roots;
    /// `sslcert=PATH&sslkey=PATH` is a client certificate. Without a password in the URL,
    /// `PGPASSWORD` or the password file (`PGPASSFILE`, `~/.pgpass`) supplies it.
    ///
    /// # Errors
    /// Database errors when the connection fails.
    pub async fn connect(url: &str, config: StoreConfig) -> Result<Self> {
        super::install_tls_provider();
        // One direct connection first: an unreachable server or a bad password is
        // reported as itself at once, not as a pool timeout later. sqlx has no connect
        // timeout for PostgreSQL, so the bound is ours: a server that accepts TCP and never
        // answers fails this within ACQUIRE_TIMEOUT.
        let conn =
            super::bounded_connect(<sqlx::PgConnection as sqlx::Connection>::connect(url)).await?;
        sqlx::Connection::close(conn).await?;
        // The pool's acquire_timeout bounds the wait for a connection, opening one included.
        let pool = super::ping_when_idle(PgPoolOptions::new())
            .max_connections(8)
            .acquire_timeout(super::ACQUIRE_TIMEOUT)
            .connect(url)
            .await?;
        let mut store = Self::from_pool(pool, config);
        if let Some(inner) = Arc::get_mut(&mut store.inner) {
            inner.url = Some(url.to_owned());
        }
        Ok(store)
    }

    /// Uses an existing pool (for example the application's). Wake-up by `LISTEN` then
    /// needs [`PgStore::connect`]'s URL; with a pool alone the relay polls.
    pub fn from_pool(pool: PgPool, config: StoreConfig) -> Self {
        let sql = Sql::new(config.schema.as_str());
        PgStore {
            inner: Arc::new(Inner {
                pool,
                config,
                sql,
                url: None,
                wakeup: super::Wakeup::new(),
            }),
        }
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The store's settings.
    pub fn config(&self) -> &StoreConfig {
        &self.inner.config
    }

    fn s(&self) -> &str {
        self.inner.config.schema.as_str()
    }

    /// One parker at a time ([`Maintenance::park_held`], [`Maintenance::unpark_released`]): two
    /// relays updating the same parked rows in different orders could deadlock. With
    /// `wait`, waits for it (a park is one statement); else false when another
    /// transaction holds it.
    async fn parking_lock(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        wait: bool,
    ) -> Result<bool> {
        let key = format!("outbox-park-{}", self.s());
        if wait {
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
                .bind(key)
                .execute(&mut **tx)
                .await?;
            return Ok(true);
        }
        Ok(
            sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext($1))")
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
    async fn unpark_keys(
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

    /// The claim statement for `req` (see [`claim_sql`], [`claim_ordered_sql`]).
    fn claim_statement(&self, req: &ClaimRequest) -> SqlStr {
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
    fn claim_text(&self, req: &ClaimRequest, update: &str) -> String {
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

    /// Enqueues `msg` inside the caller's transaction. Idempotent on the message id: when a
    /// row with that id exists, its id comes back with `inserted: false` and the
    /// transaction stays usable.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] / [`Error::MessageTooLarge`] before any SQL runs (the
    /// transaction is untouched); [`Error::Database`] from the insert.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        msg: &Message,
    ) -> Result<Enqueued> {
        msg.validate(self.inner.config.max_message_bytes)?;
        let inserted: Option<i64> = sqlx::query_scalar(self.inner.sql.enqueue.clone())
            .bind(msg.message_id)
            .bind(&msg.topic)
            .bind(msg.key.as_deref())
            .bind(msg.payload.as_ref())
            .bind(msg.headers_json())
            .bind(msg.available_at)
            .bind(msg.delay_ms())
            .fetch_optional(&mut **tx)
            .await?;
        match inserted {
            Some(id) => Ok(Enqueued {
                id,
                message_id: msg.message_id,
                inserted: true,
            }),
            None => {
                let s = &self.inner.config.schema;
                let id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT id FROM {s}.messages WHERE message_id = $1"
                )))
                .bind(msg.message_id)
                .fetch_one(&mut **tx)
                .await?;
                Ok(Enqueued {
                    id,
                    message_id: msg.message_id,
                    inserted: false,
                })
            }
        }
    }

    /// Accepts the message (an [`Envelope`](crate::Envelope) or its id) for `consumer` inside the consumer's transaction (see
    /// [`crate::inbox`]): inserts the inbox row first, under the primary key
    /// `(consumer, message_id)`, with `ON CONFLICT DO NOTHING`. [`Accepted::Fresh`] means
    /// do the work in this transaction; [`Accepted::Duplicate`] means it was done (or a
    /// concurrent transaction holding the same id committed while this one waited): skip
    /// it. A duplicate raises no error, so the transaction stays usable either way; a
    /// rollback removes the row with the rest. Run the transaction at `READ COMMITTED`
    /// (PostgreSQL's default): at `REPEATABLE READ` a duplicate committed after the
    /// snapshot fails with a serialization error (SQLSTATE 40001) to be retried.
    ///
    /// ```no_run
    /// # async fn f(store: outbox::postgres::PgStore, incoming: outbox::Envelope) -> Result<(), outbox::Error> {
    /// use outbox::inbox::Accepted;
    /// let mut tx = store.pool().begin().await?;
    /// if store.inbox_accept(&mut tx, "billing", &incoming).await? == Accepted::Fresh {
    ///     // ... the business change on &mut *tx ...
    /// }
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for a consumer name that is empty, over 255 bytes or
    /// holds a control character, before any SQL runs; [`Error::Database`] from the insert.
    pub async fn inbox_accept(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        consumer: &str,
        message: impl crate::inbox::Incoming,
    ) -> Result<Accepted> {
        let message_id = message.message_id();
        crate::inbox::validate_consumer(consumer)?;
        let r = sqlx::query(self.inner.sql.inbox_accept.clone())
            .bind(consumer)
            .bind(message_id)
            .execute(&mut **tx)
            .await?;
        Ok(Accepted::from_rows(r.rows_affected()))
    }

    /// The limit `{schema}.enqueue(...)` enforces (written by [`Maintenance::migrate`] from
    /// [`StoreConfig::max_message_bytes`]), in bytes; `None` before the first migration.
    ///
    /// # Errors
    /// Database errors other than a missing schema.
    pub async fn sql_enqueue_limit(&self) -> Result<Option<usize>> {
        let s = &self.inner.config.schema;
        let r: std::result::Result<i32, sqlx::Error> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT max_message_bytes FROM {s}.control WHERE id"
        )))
        .fetch_one(&self.inner.pool)
        .await;
        match r {
            Ok(n) => Ok(usize::try_from(n).ok()),
            // 42P01 undefined table, 3F000 undefined schema
            Err(sqlx::Error::Database(db))
                if matches!(db.code().as_deref(), Some("42P01") | Some("3F000")) =>
            {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Turns the insert trigger that notifies relays on or off. Off saves producers the
    /// `pg_notify` per inserting statement; relays then find work by polling only.
    ///
    /// # Errors
    /// Database errors (the schema must be migrated).
    pub async fn set_notify(&self, on: bool) -> Result<()> {
        let s = &self.inner.config.schema;
        let verb = if on { "ENABLE" } else { "DISABLE" };
        sqlx::query(AssertSqlSafe(format!(
            "ALTER TABLE {s}.messages {verb} TRIGGER messages_notify"
        )))
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    fn start_listener(&self) {
        let Some(url) = self.inner.url.clone() else {
            return;
        };
        let channel = format!("{}_messages", self.inner.config.schema);
        self.inner
            .wakeup
            .start_once(|bump| listen_loop(url, channel, bump));
    }

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
    fn chunk_into(row: &PgRow, claim: &mut Claim) -> std::result::Result<(), Vec<i64>> {
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
                    error: super::malformed_reason(e),
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
    async fn claim_then_read(&self, req: &ClaimRequest, token: Uuid) -> Result<Claim> {
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
            .and_then(|e| DateTime::from_timestamp_micros((e * 1e6) as i64));
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
    async fn read_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Claim> {
        let s = self.s();
        let sql = format!(
            "SELECT id, message_id, convert_to(topic, {UTF8_BYTES}), convert_to(key, {UTF8_BYTES}),
                    payload, convert_to(headers::text, {UTF8_BYTES}),
                    extract(epoch FROM occurred_at)::float8, attempts
             FROM {s}.messages WHERE id = ANY($1) AND claim_token = $2 AND status = 1"
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
                            error: super::malformed_reason(Error::MalformedRow {
                                id,
                                reason: format!("its text cannot be sent as UTF-8 ({e})"),
                            }),
                        }),
                        Err(e) => return Err(e.into()),
                    }
                }
                let mut claim = super::claim_from_rows(token, &rows, Self::row_to_message, |r| {
                    r.try_get::<i64, _>(0).unwrap_or(-1)
                });
                claim.malformed.extend(unsendable);
                return Ok(claim);
            }
            Err(e) => return Err(e.into()),
        };
        Ok(super::claim_from_rows(
            token,
            &rows,
            Self::row_to_message,
            |r| r.try_get::<i64, _>(0).unwrap_or(-1),
        ))
    }

    /// One row of [`PgStore::read_claimed`], by position.
    fn row_to_message(row: &PgRow) -> std::result::Result<OutgoingMessage, Dead> {
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
            error: super::malformed_reason(e),
        })
    }
}

/// A row's time as read for people and for ages: clamped to the years chrono (and so
/// sqlx's decoding) can represent, -4713 to 262142. PostgreSQL stores later years and
/// `±infinity` in a hand-written row; sqlx panics decoding a time past chrono's range, and
/// `now() - 'infinity'` is an error, so one such row would fail `dead list`, the message
/// look-up and `status` for every row.
macro_rules! shown_time {
    ($col:literal) => {
        concat!(
            "CASE WHEN ", $col, " IS NULL THEN NULL ELSE greatest(least(", $col,
            ", '262142-12-31 00:00:00+00'::timestamptz), '4713-11-24 00:00:00+00 BC'::timestamptz) END"
        )
    };
}
const OCCURRED_AT: &str = shown_time!("occurred_at");
const AVAILABLE_AT: &str = shown_time!("available_at");
const LOCKED_UNTIL: &str = shown_time!("locked_until");
const DISPATCHED_AT: &str = shown_time!("dispatched_at");

/// The encoding `convert_to(text, …)` is given to read text as UTF-8 bytes: UTF-8, but in a
/// `SQL_ASCII` database (which holds bytes with no encoding to convert from) the bytes as
/// they are stored, for the reader to check.
const UTF8_BYTES: &str =
    "CASE getdatabaseencoding() WHEN 'SQL_ASCII' THEN 'SQL_ASCII' ELSE 'UTF8' END";

/// Whether `e` is the server refusing to send a value's text in the connection's encoding
/// (SQLSTATE 22021 `character_not_in_repertoire`, 22P05 `untranslatable_character`): in a
/// `SQL_ASCII` database a text column holds any bytes, and those that are not UTF-8 fail
/// the whole statement that returns them to a UTF-8 client, as sqlx's is.
fn text_not_sendable(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("22021" | "22P05")))
}

/// Connects the listener: a pool of one connection of its own whose acquire (connection
/// included) is bounded by [`super::ACQUIRE_TIMEOUT`], then `LISTEN`. The listener does not
/// reconnect by itself (`eager_reconnect(false)`): [`listen_loop`] does, so that it can say
/// so.
async fn listen(url: &str, channel: &str) -> std::result::Result<PgListener, sqlx::Error> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(super::ACQUIRE_TIMEOUT)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy(url)?;
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.eager_reconnect(false);
    listener.listen(channel).await?;
    Ok(listener)
}

/// Forwards notifications to `wake` and keeps the listener connected. A loss (or a first
/// connection that fails) is logged once as a warning, and the reconnection once, with the
/// outage's length; the attempts in between are silent (capped backoff, 100 ms doubling to
/// 30 s), so an outage of any length costs two log lines. The backoff is reset only by a
/// connection that stayed up for a while, so a connection that keeps dropping at once
/// logs at most twice per 30 s. Every (re)connect and every loss wakes the relay, since
/// notifications sent while disconnected are lost; relays poll meanwhile.
async fn listen_loop(url: String, channel: String, wake: super::Bump) {
    const FIRST_DELAY: Duration = Duration::from_millis(100);
    const MAX_DELAY: Duration = Duration::from_secs(30);
    let mut delay = FIRST_DELAY;
    let mut lost_since: Option<std::time::Instant> = None;
    loop {
        let mut listener = match listen(&url, &channel).await {
            Ok(l) => l,
            Err(e) => {
                if lost_since.is_none() {
                    tracing::warn!(error = %e, "outbox listener cannot connect; relays poll until it is back");
                    lost_since = Some(std::time::Instant::now());
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_DELAY);
                continue;
            }
        };
        if let Some(since) = lost_since.take() {
            tracing::info!(outage = ?since.elapsed(), "outbox listener reconnected");
        }
        let connected_at = std::time::Instant::now();
        wake.bump();
        let why = loop {
            match listener.try_recv().await {
                Ok(Some(_)) => wake.bump(),
                Ok(None) => break "the connection was closed".to_owned(),
                Err(e) => break e.to_string(),
            }
        };
        drop(listener);
        tracing::warn!(error = %why, "outbox listener lost its connection; relays poll until it is back");
        lost_since = Some(std::time::Instant::now());
        wake.bump();
        if connected_at.elapsed() >= MAX_DELAY {
            delay = FIRST_DELAY;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(MAX_DELAY);
    }
}

/// `occurred_at` comes back as epoch seconds: a hand-written `'infinity'` must become a
/// malformed row, not a decoding panic.
fn epoch_to_time(id: i64, secs: f64) -> Result<DateTime<Utc>> {
    if secs.is_finite()
        && let Some(t) = DateTime::<Utc>::from_timestamp_micros((secs * 1e6).round() as i64)
    {
        return Ok(t);
    }
    Err(Error::MalformedRow {
        id,
        reason: format!("occurred_at is not a representable time ({secs})"),
    })
}

#[async_trait]
impl Relaying for PgStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn check_schema(&self) -> Result<()> {
        let s = self.inner.config.schema.as_str();
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM information_schema.tables
                            WHERE table_schema = $1 AND table_name = 'schema_migrations')",
        )
        .bind(s)
        .fetch_one(&self.inner.pool)
        .await?;
        let found = if exists {
            sqlx::query_scalar(self.inner.sql.version.clone())
                .fetch_one(&self.inner.pool)
                .await?
        } else {
            0
        };
        if found != SCHEMA_VERSION {
            return Err(Error::NotMigrated {
                schema: s.to_owned(),
                found,
                expected: SCHEMA_VERSION,
            });
        }
        Ok(())
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim> {
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
            .and_then(|e| DateTime::from_timestamp_micros((e * 1e6) as i64));
        Ok(claim)
    }

    async fn settle(&self, token: Uuid, settlement: &Settlement) -> Result<Settled> {
        if settlement.delete_dispatched && !settlement.dispatched.is_empty() {
            return super::settle_deleting(self, token, settlement).await;
        }
        if settlement.is_empty() {
            return Ok(Settled::default());
        }
        if settlement.len() == settlement.dispatched.len() {
            let changed: Vec<i64> = sqlx::query_scalar(self.inner.sql.mark.clone())
                .bind(&settlement.dispatched)
                .bind(token)
                .fetch_one(&self.inner.pool)
                .await?;
            return Ok(super::settled(settlement, changed));
        }
        let r = &settlement.retries;
        let q = &settlement.dead;
        let changed: Vec<i64> = sqlx::query_scalar(self.inner.sql.settle.clone())
            .bind(&settlement.dispatched)
            .bind(r.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(r.iter().map(|r| millis(r.delay)).collect::<Vec<_>>())
            .bind(r.iter().map(|r| r.error.clone()).collect::<Vec<_>>())
            .bind(r.iter().map(|r| r.refund_attempt).collect::<Vec<_>>())
            .bind(q.iter().map(|d| d.id).collect::<Vec<_>>())
            .bind(q.iter().map(|d| d.error.clone()).collect::<Vec<_>>())
            .bind(&settlement.release)
            .bind(token)
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(super::settled(settlement, changed))
    }

    async fn delete_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let s = &self.inner.config.schema;
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "WITH d AS (
               DELETE FROM {s}.messages WHERE id = ANY($1) AND claim_token = $2 AND status = 1
               RETURNING id)
             SELECT coalesce(array_agg(id), '{{}}') FROM d"
        )))
        .bind(ids)
        .bind(token)
        .fetch_one(&self.inner.pool)
        .await?)
    }

    async fn renew(&self, token: Uuid, ids: &[i64], lease: Duration) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_scalar(self.inner.sql.renew.clone())
            .bind(token)
            .bind(millis(lease))
            .bind(ids)
            .fetch_one(&self.inner.pool)
            .await?)
    }

    async fn pause_state(&self) -> Result<PauseState> {
        let (paused, reason, changed_at, topics): (bool, Option<String>, DateTime<Utc>, String) =
            sqlx::query_as(self.inner.sql.pause_state.clone())
                .fetch_one(&self.inner.pool)
                .await?;
        let mut topics: Vec<(String, String, String, i64)> =
            serde_json::from_str(&topics).unwrap_or_default();
        topics.sort();
        Ok(PauseState {
            paused,
            reason,
            changed_at: Some(changed_at),
            topics: topics
                .into_iter()
                .map(|(pattern, reason, by, at)| TopicPause {
                    pattern,
                    reason,
                    by,
                    paused_at: DateTime::from_timestamp_millis(at).unwrap_or_default(),
                })
                .collect(),
        })
    }

    fn wakeups(&self) -> watch::Receiver<u64> {
        self.start_listener();
        self.inner.wakeup.subscribe()
    }
}

#[async_trait]
impl Maintenance for PgStore {
    async fn migrate(&self) -> Result<()> {
        let s = self.inner.config.schema.as_str();
        let mut tx = self.inner.pool.begin().await?;
        // One migrator at a time, across processes.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("outbox-migrate-{s}"))
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {s};
             CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
                 version bigint PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now());"
        )))
        .execute(&mut *tx)
        .await?;
        let current: i64 = sqlx::query_scalar(self.inner.sql.version.clone())
            .fetch_one(&mut *tx)
            .await?;
        for (i, m) in migrations(s).into_iter().enumerate() {
            let version = i as i64 + 1;
            if version <= current {
                continue;
            }
            sqlx::raw_sql(AssertSqlSafe(m)).execute(&mut *tx).await?;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {s}.schema_migrations (version) VALUES ($1)"
            )))
            .bind(version)
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {s}.control SET max_message_bytes = $1 WHERE id"
        )))
        .bind(i32::try_from(self.inner.config.max_message_bytes).unwrap_or(i32::MAX))
        .execute(&mut *tx)
        .await?;
        let stored: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT pattern FROM {s}.topic_pauses"
        )))
        .fetch_all(&mut *tx)
        .await?;
        for (pattern, regex) in super::pause_regexes(stored) {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {s}.topic_pauses SET regex = $2 WHERE pattern = $1"
            )))
            .bind(pattern)
            .bind(regex)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn purge(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch> {
        let s = &self.inner.config.schema;
        let mut tx = self.inner.pool.begin().await?;
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext($1))")
            .bind(format!("outbox-purge-{s}"))
            .fetch_one(&mut *tx)
            .await?;
        if !got {
            return Ok(PurgeBatch {
                deleted: 0,
                locked_out: true,
            });
        }
        let r = sqlx::query(self.inner.sql.purge.clone())
            .bind(millis(older_than))
            .bind(i64::from(batch_size))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        crate::metrics::purged(r.rows_affected());
        Ok(PurgeBatch {
            deleted: r.rows_affected(),
            locked_out: false,
        })
    }

    async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> Result<u64> {
        if batch_size == 0 {
            return Ok(0);
        }
        let r = sqlx::query(self.inner.sql.inbox_purge.clone())
            .bind(millis(older_than))
            .bind(i64::from(batch_size))
            .execute(&self.inner.pool)
            .await?;
        Ok(r.rows_affected())
    }

    async fn park_held(&self, ordering: &KeyOrdering) -> Result<u64> {
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
               AND m.id > b.id AND m.key IS NOT NULL AND m.status = 0
               AND m.available_at <= now()"
        )))
        .bind(ordering.regexes())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(parked)
    }

    async fn unpark_released(&self, ordering: &KeyOrdering) -> Result<u64> {
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
}

#[async_trait]
impl Registry for PgStore {
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(format!(
            "WITH up AS (
               INSERT INTO {s}.relays (relay_id, host, pid, version, sink, in_flight, last_claim_at,
                                       destinations, instance, lease_ms)
               VALUES ($1, $2, $3, $4, $5, $6, now() - $7 * interval '1 millisecond', $8, $9, $10)
               ON CONFLICT (relay_id, instance) DO UPDATE SET lease_ms = excluded.lease_ms,
                   host = excluded.host, pid = excluded.pid, version = excluded.version,
                   sink = excluded.sink, in_flight = excluded.in_flight, last_seen = now(),
                   last_claim_at = excluded.last_claim_at, destinations = excluded.destinations
               RETURNING 1)
             DELETE FROM {s}.relays WHERE last_seen < now() - interval '1 hour'"
        )))
        .bind(&beat.relay_id)
        .bind(&beat.host)
        .bind(beat.pid)
        .bind(&beat.version)
        .bind(&beat.sink)
        .bind(beat.in_flight)
        .bind(beat.last_claim_ago.map(millis))
        .bind(super::ops::destinations_json(&beat.destinations))
        .bind(&beat.instance)
        .bind(millis(beat.lease))
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {s}.relays WHERE relay_id = $1 AND instance = $2"
        )))
        .bind(relay_id)
        .bind(instance)
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>> {
        let s = self.s();
        type Row = (
            String,
            String,
            i64,
            String,
            String,
            i64,
            DateTime<Utc>,
            DateTime<Utc>,
            f64,
            Option<DateTime<Utc>>,
            Option<String>,
            String,
        );
        let rows: Vec<Row> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT relay_id, host, pid, version, sink, in_flight, started_at, last_seen,
                    extract(epoch FROM now() - last_seen)::float8, last_claim_at, destinations,
                    instance
             FROM {s}.relays WHERE last_seen >= now() - $1 * interval '1 millisecond'
             ORDER BY started_at, relay_id, instance"
        )))
        .bind(millis(within))
        .fetch_all(&self.inner.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| RelayRecord {
                relay_id: r.0,
                instance: r.11,
                host: r.1,
                pid: r.2,
                version: r.3,
                sink: r.4,
                in_flight: r.5,
                started_at: r.6,
                last_seen: r.7,
                last_seen_ago_s: r.8.max(0.0),
                last_claim_at: r.9,
                destinations: super::ops::parse_destinations(r.10.as_deref()),
            })
            .collect())
    }
}

#[async_trait]
impl Operations for PgStore {
    async fn set_pause(&self, reason: Option<&str>) -> Result<()> {
        // The claim reads the switch itself; the notification makes a resume take effect
        // at once instead of at the relays' next poll.
        let mut tx = self.inner.pool.begin().await?;
        sqlx::query(self.inner.sql.set_pause.clone())
            .bind(reason.is_some())
            .bind(reason)
            .execute(&mut *tx)
            .await?;
        if reason.is_none() {
            let s = self.s();
            sqlx::query(AssertSqlSafe(format!(
                "SELECT pg_notify('{s}_messages', '')"
            )))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn dead_letters(
        &self,
        selector: &DeadSelector,
        limit: u32,
        with_payload: bool,
    ) -> Result<Vec<DeadLetter>> {
        let s = self.s();
        let (filter, binds) = ops::dead_filter(selector, Dialect::Postgres, 1);
        let payload = if with_payload {
            "payload"
        } else {
            "NULL::bytea"
        };
        // Text as bytes: a malformed row's text may not be UTF-8 (see `read_claimed`), and
        // is shown with U+FFFD for what is not, rather than failing the whole list.
        let sql = format!(
            "SELECT id, message_id, convert_to(topic, {UTF8_BYTES}) AS topic,
                    convert_to(key, {UTF8_BYTES}) AS key, attempts, {OCCURRED_AT} AS occurred_at,
                    {AVAILABLE_AT} AS available_at, last_error, convert_to(headers::text, {UTF8_BYTES}) AS headers,
                    octet_length(payload)::bigint AS payload_bytes,
                    {payload} AS payload, replay_id,
                    (SELECT count(*) FROM {s}.messages l
                     WHERE l.topic = m.topic AND md5(l.key) = md5(m.key) AND l.key = m.key
                       AND l.status <> 2 AND l.status <= 1 AND l.id > m.id) AS waiting_behind
             FROM {s}.messages m WHERE {filter} ORDER BY id LIMIT {limit}"
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for b in binds {
            query = query.bind(b);
        }
        let rows = query.fetch_all(&self.inner.pool).await?;
        rows.iter()
            .map(|r| {
                Ok(DeadLetter {
                    id: r.try_get("id")?,
                    message_id: r.try_get("message_id")?,
                    topic: super::lossy(r.try_get("topic")?),
                    key: r.try_get::<Option<Vec<u8>>, _>("key")?.map(super::lossy),
                    attempts: r.try_get("attempts")?,
                    occurred_at: r.try_get("occurred_at")?,
                    died_at: r.try_get("available_at")?,
                    last_error: r.try_get("last_error")?,
                    headers: super::lossy(r.try_get("headers")?),
                    payload_bytes: r.try_get("payload_bytes")?,
                    payload: r.try_get("payload")?,
                    replay_id: r.try_get("replay_id")?,
                    waiting_behind: r.try_get("waiting_behind")?,
                })
            })
            .collect()
    }

    async fn count_dead(&self, selector: &DeadSelector) -> Result<u64> {
        let s = self.s();
        let (filter, binds) = ops::dead_filter(selector, Dialect::Postgres, 1);
        let sql = format!("SELECT count(*) FROM {s}.messages WHERE {filter}");
        let mut query = sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql));
        for b in binds {
            query = query.bind(b);
        }
        Ok(u64::try_from(query.fetch_one(&self.inner.pool).await?).unwrap_or(0))
    }

    async fn replay(&self, req: &ReplayRequest) -> Result<ReplayOutcome> {
        ops::validate(req)?;
        let s = self.s();
        let mut tx = self.inner.pool.begin().await?;
        let refused = if let Some(filter) = ops::named_filter(&req.selector, Dialect::Postgres) {
            let found: Vec<(i64, Uuid, i16)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT id, message_id, status FROM {s}.messages WHERE {filter}"
            )))
            .fetch_all(&mut *tx)
            .await?;
            ops::refusals(&req.selector, &found)
        } else {
            Vec::new()
        };
        let (filter, binds) = ops::dead_filter(&req.selector, Dialect::Postgres, 1);
        let limit = req
            .limit
            .map_or_else(|| "ALL".to_owned(), |l| l.to_string());
        // Locks the selected rows: a concurrent replay of the same rows waits, then finds
        // them no longer dead.
        let mut query = sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
            "SELECT id FROM {s}.messages WHERE {filter} ORDER BY id LIMIT {limit} FOR UPDATE"
        )));
        for b in binds {
            query = query.bind(b);
        }
        let ids = query.fetch_all(&mut *tx).await?;
        let sample: Vec<i64> = ids.iter().take(20).copied().collect();
        ops::check_spread(ids.len(), req.rate_per_s)?;
        if req.dry_run || ids.is_empty() {
            return Ok(ReplayOutcome {
                replay_id: None,
                count: ids.len() as u64,
                sample,
                refused,
            });
        }
        let replay_id: i64 = match req.append_to {
            Some(id) => id,
            None => {
                sqlx::query_scalar(AssertSqlSafe(format!(
                    "INSERT INTO {s}.replays (requested_by, reason, action, selection)
                     VALUES ($1, $2, $3, $4) RETURNING id"
                )))
                .bind(&req.by)
                .bind(&req.reason)
                .bind(req.action.as_str())
                .bind(req.describe())
                .fetch_one(&mut *tx)
                .await?
            }
        };
        // The keyed rows among them, whose parked followers are given back below; their
        // text as bytes, which any row's text can be sent as (see `read_claimed`).
        let keyed: Vec<(i64, Vec<u8>, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, convert_to(topic, {UTF8_BYTES}), convert_to(key, {UTF8_BYTES})
             FROM {s}.messages WHERE id = ANY($1) AND key IS NOT NULL"
        )))
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
        let delays: Vec<i64> = (0..ids.len())
            .map(|k| ops::spread_ms(k, req.rate_per_s))
            .collect();
        let changed = match req.action {
            ReplayAction::Replay => sqlx::query(AssertSqlSafe(format!(
                "UPDATE {s}.messages m
                     SET status = 0, attempts = 0, replay_id = $3,
                         available_at = now() + x.delay_ms * interval '1 millisecond',
                         claim_token = NULL, locked_until = NULL, dispatched_at = NULL
                     FROM unnest($1::bigint[], $2::bigint[]) AS x(id, delay_ms)
                     WHERE m.id = x.id AND m.status = 3"
            )))
            .bind(&ids)
            .bind(&delays)
            .bind(replay_id)
            .execute(&mut *tx)
            .await?
            .rows_affected(),
            ReplayAction::Discard | ReplayAction::Purge => sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {s}.messages WHERE id = ANY($1) AND status = 3"
            )))
            .bind(&ids)
            .execute(&mut *tx)
            .await?
            .rows_affected(),
        };
        // A replayed row is due after its spread delay (its followers then, too); a deleted
        // one releases its followers now.
        let delay_of: std::collections::HashMap<i64, i64> = match req.action {
            ReplayAction::Replay => ids.iter().copied().zip(delays.iter().copied()).collect(),
            ReplayAction::Discard | ReplayAction::Purge => Default::default(),
        };
        let at = |id: i64| delay_of.get(&id).copied().unwrap_or(0);
        self.unpark_keys(
            &mut tx,
            &keyed.iter().map(|k| k.0).collect::<Vec<_>>(),
            &keyed.iter().map(|k| k.1.clone()).collect::<Vec<_>>(),
            &keyed.iter().map(|k| k.2.clone()).collect::<Vec<_>>(),
            &keyed.iter().map(|k| at(k.0)).collect::<Vec<_>>(),
        )
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {s}.replays SET count = count + $1 WHERE id = $2"
        )))
        .bind(changed as i64)
        .bind(replay_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(ReplayOutcome {
            replay_id: Some(replay_id),
            count: changed,
            sample,
            refused,
        })
    }

    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>> {
        let s = self.s();
        let rows: Vec<(i64, DateTime<Utc>, String, String, String, String, i64)> =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT id, at, requested_by, reason, action, selection, count
                 FROM {s}.replays ORDER BY id DESC LIMIT $1"
            )))
            .bind(i64::from(limit))
            .fetch_all(&self.inner.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(
                |(id, at, by, reason, action, selection, count)| ReplayRecord {
                    id,
                    at,
                    by,
                    reason,
                    action,
                    selection,
                    count,
                },
            )
            .collect())
    }

    async fn pause_topic(&self, pattern: &TopicPattern, reason: &str, by: &str) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.topic_pauses (pattern, reason, paused_by, regex) VALUES ($1, $2, $3, $4)
             ON CONFLICT (pattern) DO UPDATE SET reason = excluded.reason,
                 paused_by = excluded.paused_by, paused_at = now(), regex = excluded.regex"
        )))
        .bind(pattern.as_str())
        .bind(reason)
        .bind(by)
        .bind(pattern.regex())
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    async fn resume_topic(&self, pattern: &str) -> Result<bool> {
        let s = self.s();
        // The notification makes the resumed topics flow at once, not at the next poll.
        let mut tx = self.inner.pool.begin().await?;
        let r = sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {s}.topic_pauses WHERE pattern = $1"
        )))
        .bind(pattern)
        .execute(&mut *tx)
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "SELECT pg_notify('{s}_messages', '')"
        )))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(r.rows_affected() > 0)
    }

    async fn audit(&self, entry: &super::ops::AuditEntry) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.replays (requested_by, reason, action, selection)
             VALUES ($1, $2, $3, $4)"
        )))
        .bind(&entry.by)
        .bind(&entry.reason)
        .bind(&entry.action)
        .bind(&entry.selection)
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }
}

#[async_trait]
impl Views for PgStore {
    async fn counts(&self) -> Result<Counts> {
        let row: super::CountsRow = sqlx::query_as(self.inner.sql.counts.clone())
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(row.into())
    }

    async fn leases(&self) -> Result<Leases> {
        let (held, last, ms): (i64, Option<DateTime<Utc>>, Option<i64>) =
            sqlx::query_as(self.inner.sql.leases.clone())
                .fetch_one(&self.inner.pool)
                .await?;
        Ok(Leases::from_row(held, last, ms))
    }

    async fn cleanup_horizon(&self) -> Result<super::CleanupHorizon> {
        let pool = &self.inner.pool;
        // Sessions of this database (since PostgreSQL 14 only they hold back the cleanup of
        // its tables) with a snapshot or a transaction id, and prepared transactions; this
        // connection's own statement excluded.
        let oldest: Option<(
            String,
            f64,
            Option<i64>,
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
        )> = sqlx::query_as(
            "SELECT kind, age_s, pid, usr, app, state, gid FROM (
                   SELECT 'session'::text AS kind,
                          extract(epoch FROM clock_timestamp() - xact_start)::float8 AS age_s,
                          pid::int8 AS pid, usename::text AS usr,
                          nullif(application_name, '')::text AS app, state::text AS state,
                          NULL::text AS gid
                   FROM pg_stat_activity
                   WHERE datname = current_database() AND pid <> pg_backend_pid()
                     AND xact_start IS NOT NULL
                     AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
                   UNION ALL
                   SELECT 'prepared', extract(epoch FROM clock_timestamp() - prepared)::float8,
                          NULL, owner::text, NULL, NULL, gid
                   FROM pg_prepared_xacts WHERE database = current_database()
                 ) h ORDER BY age_s DESC LIMIT 1",
        )
        .fetch_optional(pool)
        .await?;
        let (xmin_age, slot, slot_age): (Option<i64>, Option<String>, Option<i64>) =
            sqlx::query_as(
                "SELECT greatest(a.x, p.x, s.x)::int8, s.slot_name::text, s.x FROM
                   (SELECT max(greatest(age(backend_xmin), age(backend_xid)))::int8 AS x
                    FROM pg_stat_activity
                    WHERE datname = current_database() AND pid <> pg_backend_pid()) a
                   CROSS JOIN (SELECT max(age(transaction))::int8 AS x FROM pg_prepared_xacts
                               WHERE database = current_database()) p
                   LEFT JOIN (SELECT slot_name, age(xmin)::int8 AS x FROM pg_replication_slots
                              WHERE xmin IS NOT NULL ORDER BY age(xmin) DESC LIMIT 1) s ON true",
            )
            .fetch_one(pool)
            .await?;
        Ok(super::CleanupHorizon {
            oldest: oldest.map(|(kind, age_s, pid, user, application, state, gid)| {
                super::OldTransaction {
                    kind,
                    age_s: age_s.max(0.0),
                    pid,
                    user,
                    application,
                    state,
                    gid,
                }
            }),
            xmin_age,
            slot: slot.zip(slot_age),
            history_length: None,
        })
    }

    async fn held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys> {
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

    async fn due_held_by_order(&self, ordering: &KeyOrdering) -> Result<DueHeld> {
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
                      coalesce(head.id <> m.id AND (head.status = 3 OR head.available_at > now()),
                               false) AS held
               FROM {s}.messages m
               LEFT JOIN LATERAL (
                 SELECT h.id, h.status, h.available_at FROM {s}.messages h
                 WHERE m.key IS NOT NULL AND m.topic ~ ANY($1::text[])
                   AND h.topic = m.topic AND md5(h.key) = md5(m.key)
                   AND h.key IS NOT NULL AND h.status <> 2{not_dead}
                 ORDER BY h.topic, md5(h.key), h.id LIMIT 1) head ON true
               WHERE m.status <= 1 AND m.available_at <= now()) d"
        )))
        .bind(ordering.regexes())
        .fetch_one(&self.inner.pool)
        .await?;
        Ok(DueHeld {
            held,
            oldest_free_due_s: oldest_free.map(|s| s.max(0)),
        })
    }

    async fn overview(&self, top_n: u32) -> Result<Overview> {
        let s = self.s();
        let pool = &self.inner.pool;
        let counts = self.counts().await?;
        let (due, oldest_due, expired): (i64, Option<i64>, i64) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT count(*), floor(extract(epoch FROM now() - min({AVAILABLE_AT})))::bigint,
                        count(*) FILTER (WHERE status = 1)
                 FROM {s}.messages WHERE status <= 1 AND available_at <= now()"
            )))
            .fetch_one(pool)
            .await?;
        let parked: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {s}.messages
             WHERE status <= 1 AND available_at = '{PARKED_AT}'"
        )))
        .fetch_one(pool)
        .await?;
        // Each claim goes to the latest-started live instance of its relay id whose start
        // plus lease is not after the claim's lease end (none: an earlier process's).
        let claims_by: Vec<(Option<String>, Option<String>, i64, i64)> =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT m.claimed_by,
                        (SELECT r.instance FROM {s}.relays r
                         WHERE r.relay_id = m.claimed_by
                           AND r.last_seen >= now() - {expiry} * interval '1 millisecond'
                           AND r.started_at + r.lease_ms * interval '1 millisecond' <= m.available_at
                         ORDER BY r.started_at DESC, r.instance LIMIT 1) AS instance,
                        count(*), count(*) FILTER (WHERE m.available_at <= now())
                 FROM {s}.messages m WHERE m.status = 1 GROUP BY 1, 2 ORDER BY 1, 2",
                expiry = super::RELAY_EXPIRY.as_millis()
            )))
        .fetch_all(pool)
        .await?;
        let by_topic = async |status: i16| -> Result<Vec<(String, i64)>> {
            let rows: Vec<(Vec<u8>, i64)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT convert_to(topic, {UTF8_BYTES}), count(*) FROM {s}.messages
                 WHERE status = $1 GROUP BY topic ORDER BY count(*) DESC, topic LIMIT $2"
            )))
            .bind(status)
            .bind(i64::from(top_n))
            .fetch_all(pool)
            .await?;
            Ok(rows
                .into_iter()
                .map(|(t, n)| (super::lossy(t), n))
                .collect())
        };
        Ok(Overview {
            counts,
            due,
            oldest_due_s: oldest_due.map(|s| s.max(0)),
            expired_claims: expired,
            parked,
            claims_by: claims_by
                .into_iter()
                .map(|(r, instance, claimed, expired)| ClaimsBy {
                    relay_id: r.unwrap_or_default(),
                    instance,
                    claimed,
                    expired,
                })
                .collect(),
            pending_by_topic: by_topic(super::status::PENDING).await?,
            dead_by_topic: by_topic(super::status::DEAD).await?,
        })
    }

    async fn find_messages(
        &self,
        query: &super::lookup::MessageQuery,
        limit: u32,
    ) -> Result<Vec<super::lookup::MessageLocation>> {
        use super::lookup::MessageQuery;
        let s = self.s();
        // Text as bytes, shown with U+FFFD for what is not UTF-8 (see `dead_letters`).
        let cols = format!(
            "id, message_id, convert_to(topic, {UTF8_BYTES}) AS topic,
             convert_to(key, {UTF8_BYTES}) AS key, status, attempts, {OCCURRED_AT} AS occurred_at,
             {AVAILABLE_AT} AS available_at, claimed_by, {LOCKED_UNTIL} AS locked_until,
             {DISPATCHED_AT} AS dispatched_at, last_error,
             octet_length(payload)::bigint AS payload_bytes, replay_id"
        );
        let rows = match query {
            MessageQuery::MessageId(id) => {
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT {cols} FROM {s}.messages WHERE message_id = $1"
                )))
                .bind(id)
                .fetch_all(&self.inner.pool)
                .await?
            }
            MessageQuery::Key {
                key,
                topic: Some(topic),
            } => {
                // md5(key) as the per-key index has it.
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT {cols} FROM {s}.messages
                     WHERE topic = $1 AND md5(key) = md5($2) AND key = $2
                     ORDER BY id DESC LIMIT $3"
                )))
                .bind(topic)
                .bind(key)
                .bind(i64::from(limit))
                .fetch_all(&self.inner.pool)
                .await?
            }
            MessageQuery::Key { key, topic: None } => {
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT {cols} FROM {s}.messages WHERE key = $1 ORDER BY id DESC LIMIT $2"
                )))
                .bind(key)
                .bind(i64::from(limit))
                .fetch_all(&self.inner.pool)
                .await?
            }
        };
        rows.iter()
            .map(|r| {
                Ok(super::lookup::MessageLocation {
                    id: r.try_get("id")?,
                    message_id: r.try_get("message_id")?,
                    topic: super::lossy(r.try_get("topic")?),
                    key: r.try_get::<Option<Vec<u8>>, _>("key")?.map(super::lossy),
                    status: super::lookup::status_name(i64::from(r.try_get::<i16, _>("status")?)),
                    attempts: r.try_get("attempts")?,
                    occurred_at: r.try_get("occurred_at")?,
                    available_at: r.try_get("available_at")?,
                    claimed_by: r.try_get("claimed_by")?,
                    locked_until: r.try_get("locked_until")?,
                    dispatched_at: r.try_get("dispatched_at")?,
                    last_error: r.try_get("last_error")?,
                    payload_bytes: r.try_get("payload_bytes")?,
                    replay_id: r.try_get("replay_id")?,
                }
                .noting_parked())
            })
            .collect()
    }

    async fn throughput(&self, minutes: u32) -> Result<Vec<super::lookup::MinuteCounts>> {
        let s = self.s();
        let minutes = minutes.min(super::lookup::MAX_THROUGHPUT_MINUTES);
        let rows: Vec<(i64, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT m, sum(d)::bigint, sum(x)::bigint FROM (
               SELECT floor(extract(epoch FROM now() - dispatched_at) / 60)::bigint AS m,
                      1 AS d, 0 AS x
               FROM {s}.messages
               WHERE status = 2 AND dispatched_at >= now() - $1 * interval '1 minute'
               UNION ALL
               SELECT floor(extract(epoch FROM now() - available_at) / 60)::bigint, 0, 1
               FROM {s}.messages
               WHERE status = 3 AND available_at >= now() - $1 * interval '1 minute'
             ) t GROUP BY m"
        )))
        .bind(f64::from(minutes))
        .fetch_all(&self.inner.pool)
        .await?;
        Ok(super::lookup::fill_minutes(minutes, &rows))
    }
}
