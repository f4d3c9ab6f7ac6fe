INSERT INTO {s}.messages (message_id, topic, key, payload, headers, available_at)
VALUES ($1, $2, $3, $4, $5, coalesce($6, now() + $7 * interval '1 millisecond'))
ON CONFLICT (message_id) DO NOTHING RETURNING id
