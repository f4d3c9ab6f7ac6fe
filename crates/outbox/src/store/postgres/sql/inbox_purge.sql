DELETE FROM {s}.inbox WHERE (consumer, message_id) IN (
  SELECT consumer, message_id FROM {s}.inbox
  WHERE received_at < now() - $1 * interval '1 millisecond'
  ORDER BY received_at LIMIT $2
  FOR UPDATE SKIP LOCKED)
