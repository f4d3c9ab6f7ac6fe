CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.messages (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    uuid NOT NULL UNIQUE,
    topic         text NOT NULL CHECK (topic <> ''),
    key           text,
    payload       bytea NOT NULL,
    headers       jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(headers) = 'object'),
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
