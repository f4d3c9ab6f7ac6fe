UPDATE {s}.control SET max_message_bytes = $1 WHERE id
