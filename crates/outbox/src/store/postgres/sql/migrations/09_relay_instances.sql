ALTER TABLE {s}.relays ADD COLUMN IF NOT EXISTS instance text NOT NULL DEFAULT '';
ALTER TABLE {s}.relays ADD COLUMN IF NOT EXISTS lease_ms bigint NOT NULL DEFAULT 0;
ALTER TABLE {s}.relays DROP CONSTRAINT IF EXISTS relays_pkey;
ALTER TABLE {s}.relays ADD PRIMARY KEY (relay_id, instance);
