
-- The consumer inbox: one row per (consumer, message id) a consumer accepted, written in
-- the consumer's own transaction; the purge reads it by age (integer ms, UTC).
CREATE TABLE IF NOT EXISTS {p}_inbox (
    consumer    TEXT NOT NULL CHECK (length(CAST(consumer AS BLOB)) BETWEEN 1 AND 255),
    message_id  TEXT NOT NULL,
    received_at INTEGER NOT NULL DEFAULT ({n}),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {p}_inbox_received ON {p}_inbox (received_at);
