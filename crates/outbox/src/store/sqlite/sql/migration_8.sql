CREATE TABLE {p}_relays_v8 (
                 relay_id      TEXT NOT NULL,
                 instance      TEXT NOT NULL DEFAULT '',
                 host          TEXT NOT NULL,
                 pid           INTEGER NOT NULL,
                 version       TEXT NOT NULL,
                 sink          TEXT NOT NULL,
                 in_flight     INTEGER NOT NULL DEFAULT 0,
                 started_at    INTEGER NOT NULL,
                 last_seen     INTEGER NOT NULL,
                 last_claim_at INTEGER,
                 destinations  TEXT,
                 lease_ms      INTEGER NOT NULL DEFAULT 0,
                 PRIMARY KEY (relay_id, instance)
             );
             INSERT INTO {p}_relays_v8 (relay_id, host, pid, version, sink, in_flight, started_at,
                                        last_seen, last_claim_at, destinations)
             SELECT relay_id, host, pid, version, sink, in_flight, started_at, last_seen,
                    last_claim_at, destinations FROM {p}_relays;
             DROP TABLE {p}_relays;
             ALTER TABLE {p}_relays_v8 RENAME TO {p}_relays;