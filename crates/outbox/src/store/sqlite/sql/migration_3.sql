
-- Operations: dead letters by when they died (available_at), audited replays, the relay
-- registry, topic pauses.
CREATE INDEX IF NOT EXISTS {p}_messages_dead ON {p}_messages (available_at, id) WHERE status = 3;
ALTER TABLE {p}_messages ADD COLUMN replay_id INTEGER;
CREATE TABLE IF NOT EXISTS {p}_replays (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    at           INTEGER NOT NULL DEFAULT ({n}),
    requested_by TEXT NOT NULL,
    reason       TEXT NOT NULL,
    action       TEXT NOT NULL,
    selection    TEXT NOT NULL,
    count        INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS {p}_relays (
    relay_id      TEXT PRIMARY KEY,
    host          TEXT NOT NULL,
    pid           INTEGER NOT NULL,
    version       TEXT NOT NULL,
    sink          TEXT NOT NULL,
    in_flight     INTEGER NOT NULL DEFAULT 0,
    started_at    INTEGER NOT NULL,
    last_seen     INTEGER NOT NULL,
    last_claim_at INTEGER
);
CREATE TABLE IF NOT EXISTS {p}_topic_pauses (
    pattern   TEXT PRIMARY KEY,
    reason    TEXT NOT NULL,
    paused_by TEXT NOT NULL,
    paused_at INTEGER NOT NULL
);
