DELETE FROM {s}.messages WHERE id IN (
  SELECT id FROM {s}.messages
  WHERE status = 2 AND dispatched_at < now() - $1 * interval '1 millisecond'
  ORDER BY id LIMIT $2
  FOR UPDATE SKIP LOCKED)
