DELETE FROM {s}.relays WHERE relay_id = $1 AND instance = $2
