WITH d AS (
  UPDATE {s}.messages
  SET status = 2, dispatched_at = now(), locked_until = NULL, claim_token = NULL,
      last_error = NULL
  WHERE id = ANY($1) AND claim_token = $2 AND status <= 1
  RETURNING id)
SELECT coalesce(array_agg(id), '{}') FROM d
