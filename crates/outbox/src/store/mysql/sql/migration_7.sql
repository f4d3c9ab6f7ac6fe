-- Migration 7: the registry keeps each relay's destinations and their state (JSON).

-- @unless_column {p}_relays destinations
ALTER TABLE {p}_relays ADD COLUMN destinations TEXT NULL
