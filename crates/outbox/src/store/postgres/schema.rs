//! The schema: its migrations, the `enqueue(...)` SQL function, `migrate` and the version
//! check; and retention (the purges).

use super::{PgStore, SCHEMA_VERSION};
use crate::error::{Error, Result};
use crate::store::{PurgeBatch, millis};
use sqlx::AssertSqlSafe;
use std::time::Duration;

/// The `enqueue(...)` SQL function, as the latest migration defines it (v1 creates it,
/// later versions replace it).
pub(super) fn enqueue_function(s: &str) -> String {
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

/// The migrations, in order; each is applied once, in its own transaction.
pub(super) fn migrations(s: &str) -> Vec<String> {
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

impl PgStore {
    /// The limit `{schema}.enqueue(...)` enforces (written by [`Store::migrate`] from
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

    pub(super) async fn migrate(&self) -> Result<()> {
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
        for (pattern, regex) in crate::store::pause_regexes(stored) {
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

    pub(super) async fn check_schema(&self) -> Result<()> {
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

    pub(super) async fn purge(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch> {
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

    pub(super) async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> Result<u64> {
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
}
