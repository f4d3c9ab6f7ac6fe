WITH up AS (
  INSERT INTO {s}.relays (relay_id, host, pid, version, sink, in_flight, last_claim_at,
                          destinations, instance, lease_ms)
  VALUES ($1, $2, $3, $4, $5, $6, now() - $7 * interval '1 millisecond', $8, $9, $10)
  ON CONFLICT (relay_id, instance) DO UPDATE SET lease_ms = excluded.lease_ms,
      host = excluded.host, pid = excluded.pid, version = excluded.version,
      sink = excluded.sink, in_flight = excluded.in_flight, last_seen = now(),
      last_claim_at = excluded.last_claim_at, destinations = excluded.destinations
  RETURNING 1)
DELETE FROM {s}.relays WHERE last_seen < now() - interval '1 hour'
