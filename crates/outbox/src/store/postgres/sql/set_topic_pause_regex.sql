UPDATE {s}.topic_pauses SET regex = $2 WHERE pattern = $1
