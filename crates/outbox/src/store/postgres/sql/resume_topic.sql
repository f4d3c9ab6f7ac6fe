DELETE FROM {s}.topic_pauses WHERE pattern = $1
