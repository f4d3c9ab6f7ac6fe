SELECT relay_id, host, pid, version, sink, in_flight, started_at, last_seen,
       extract(epoch FROM now() - last_seen)::float8, last_claim_at, destinations,
       instance
FROM {s}.relays WHERE last_seen >= now() - $1 * interval '1 millisecond'
ORDER BY started_at, relay_id, instance
