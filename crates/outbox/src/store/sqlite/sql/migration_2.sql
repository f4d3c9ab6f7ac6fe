
CREATE INDEX IF NOT EXISTS {p}_messages_dispatched ON {p}_messages (dispatched_at) WHERE status = 2;
