CREATE INDEX IF NOT EXISTS messages_key ON {s}.messages (topic, md5(key), id)
WHERE key IS NOT NULL AND status <> 2;
