CREATE INDEX IF NOT EXISTS {p}_messages_key ON {p}_messages (topic, key, id)
             WHERE key IS NOT NULL AND status <> 2;