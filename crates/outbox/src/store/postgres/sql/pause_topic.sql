INSERT INTO {s}.topic_pauses (pattern, reason, paused_by, regex) VALUES ($1, $2, $3, $4)
ON CONFLICT (pattern) DO UPDATE SET reason = excluded.reason,
    paused_by = excluded.paused_by, paused_at = now(), regex = excluded.regex
