WITH d AS (
  UPDATE {s}.messages
  SET status = 2, dispatched_at = now(), locked_until = NULL, claim_token = NULL,
      last_error = NULL
  WHERE id = ANY($1) AND claim_token = $9 AND status <= 1
  RETURNING id),
r AS (
  UPDATE {s}.messages m
  SET status = 0, available_at = now() + x.delay_ms * interval '1 millisecond',
      last_error = x.err, locked_until = NULL, claim_token = NULL,
      attempts = CASE WHEN x.refund THEN greatest(m.attempts - 1, 0) ELSE m.attempts END
  FROM unnest($2::bigint[], $3::bigint[], $4::text[], $5::bool[])
       AS x(id, delay_ms, err, refund)
  WHERE m.id = x.id AND m.claim_token = $9 AND m.status <= 1
  RETURNING m.id),
q AS (
  UPDATE {s}.messages m
  SET status = 3, last_error = x.err, locked_until = NULL, claim_token = NULL,
      available_at = now()
  FROM unnest($6::bigint[], $7::text[]) AS x(id, err)
  WHERE m.id = x.id AND m.claim_token = $9 AND m.status <= 1
  RETURNING m.id),
l AS (
  UPDATE {s}.messages
  SET status = 0, attempts = greatest(attempts - 1, 0), available_at = now(),
      locked_until = NULL, claim_token = NULL
  WHERE id = ANY($8) AND claim_token = $9 AND status <= 1
  RETURNING id)
SELECT coalesce(array_agg(id), '{}') FROM (
  SELECT id FROM d UNION ALL SELECT id FROM r
  UNION ALL SELECT id FROM q UNION ALL SELECT id FROM l) changed
