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
