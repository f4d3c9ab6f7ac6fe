WITH r AS (
  UPDATE {s}.messages
  SET locked_until = now() + $2 * interval '1 millisecond'
  WHERE id = ANY($3) AND claim_token = $1 AND status <= 1
  RETURNING id)
SELECT coalesce(array_agg(id), '{}') FROM r
