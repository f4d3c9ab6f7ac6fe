-- Migration 6: per-key ordering. `order_key` is MD5(topic NUL key) while the row is keyed
-- and not dispatched, else NULL (no partial indexes, as `live_at`), so its index reads a
-- key's rows that are not dispatched, in id order, and never reaches the history.

-- @unless_column {p}_messages order_key
ALTER TABLE {p}_messages ADD COLUMN order_key BINARY(16) GENERATED ALWAYS AS
    (CASE WHEN status <> 2 AND `key` IS NOT NULL
          THEN UNHEX(MD5(CONCAT(topic, CHAR(0), `key`))) END) STORED,
    ADD KEY {p}_messages_key (order_key, id)
