ALTER TABLE {s}.relays ADD COLUMN IF NOT EXISTS destinations text;
