DELETE FROM {s}.messages WHERE id = ANY($1) AND status = 3
