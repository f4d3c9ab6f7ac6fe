UPDATE {s}.control SET paused = $1, reason = $2, changed_at = now() WHERE id
