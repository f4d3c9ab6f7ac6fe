-- Migration 9: a registry row per relay instance (two relays under one id each keep
-- theirs), with the instance's lease (which claims are whose). Guarded, as v3 is.

-- @unless_column {p}_relays instance
ALTER TABLE {p}_relays ADD COLUMN instance VARCHAR(64) NOT NULL,
    ADD COLUMN lease_ms BIGINT NOT NULL DEFAULT 0,
    DROP PRIMARY KEY, ADD PRIMARY KEY (relay_id, instance)
