SELECT max_message_bytes FROM {s}.control WHERE id
