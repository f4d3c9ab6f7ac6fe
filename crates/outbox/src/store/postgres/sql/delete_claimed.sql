WITH d AS (
  DELETE FROM {s}.messages WHERE id = ANY($1) AND claim_token = $2 AND status <= 1
  RETURNING id)
SELECT coalesce(array_agg(id), '{}') FROM d
