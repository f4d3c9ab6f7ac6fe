SELECT id FROM {s}.messages WHERE message_id = $1
