-- Migration 3: the operations tables (the audit of replays and discards, the relay
-- registry, topic pauses), `replay_id` on messages, and the dead-row index: the stored
-- generated column `dead_at` (`available_at`, the time of death, while status = 3, else
-- NULL) and an index on it. The `ALTER TABLE` runs only while `replay_id` is missing, so
-- a migration interrupted after it can run again. Adding a stored column rebuilds the
-- table: writes wait until it is done (as they wait for the index build on PostgreSQL).

-- @run
CREATE TABLE IF NOT EXISTS {p}_replays (
    id           BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    at           DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    requested_by TEXT NOT NULL,
    reason       TEXT NOT NULL,
    action       VARCHAR(16) NOT NULL,
    selection    TEXT NOT NULL,
    `count`      BIGINT NOT NULL DEFAULT 0
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin
-- @run
CREATE TABLE IF NOT EXISTS {p}_relays (
    relay_id      VARCHAR(255) NOT NULL PRIMARY KEY,
    host          TEXT NOT NULL,
    pid           BIGINT NOT NULL,
    version       TEXT NOT NULL,
    sink          TEXT NOT NULL,
    in_flight     BIGINT NOT NULL DEFAULT 0,
    started_at    DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    last_seen     DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    last_claim_at DATETIME(6)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin
-- @run
CREATE TABLE IF NOT EXISTS {p}_topic_pauses (
    pattern   VARCHAR(255) NOT NULL PRIMARY KEY,
    reason    TEXT NOT NULL,
    paused_by TEXT NOT NULL,
    paused_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin
-- @unless_column {p}_messages replay_id
ALTER TABLE {p}_messages
    ADD COLUMN replay_id BIGINT NULL,
    ADD COLUMN dead_at DATETIME(6) GENERATED ALWAYS AS
        (CASE WHEN status = 3 THEN available_at END) STORED,
    ADD KEY {p}_messages_dead (dead_at, id)
