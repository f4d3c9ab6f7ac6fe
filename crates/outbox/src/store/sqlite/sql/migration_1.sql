
CREATE TABLE IF NOT EXISTS {p}_messages (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id    TEXT NOT NULL UNIQUE
                  CHECK (length(message_id) = 36 AND message_id = lower(message_id)),
    topic         TEXT NOT NULL CHECK (topic <> ''),
    key           TEXT,
    payload       BLOB NOT NULL,
    headers       TEXT NOT NULL DEFAULT '{}' CHECK (json_type(headers) = 'object'),
    occurred_at   INTEGER NOT NULL DEFAULT ({n}),
    available_at  INTEGER NOT NULL DEFAULT ({n}),
    status        INTEGER NOT NULL DEFAULT 0 CHECK (status BETWEEN 0 AND 3),
    attempts      INTEGER NOT NULL DEFAULT 0,
    claimed_by    TEXT,
    claim_token   TEXT,
    locked_until  INTEGER,
    dispatched_at INTEGER,
    last_error    TEXT
);
CREATE INDEX IF NOT EXISTS {p}_messages_live ON {p}_messages (available_at, id) WHERE status <= 1;
CREATE TABLE IF NOT EXISTS {p}_control (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    paused     INTEGER NOT NULL DEFAULT 0,
    reason     TEXT,
    changed_at INTEGER NOT NULL DEFAULT ({n})
);
INSERT OR IGNORE INTO {p}_control (id) VALUES (1);
