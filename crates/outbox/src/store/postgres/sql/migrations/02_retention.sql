-- Retention: the purge reads dispatched rows by age only.
CREATE INDEX IF NOT EXISTS messages_dispatched ON {s}.messages (dispatched_at) WHERE status = 2;
