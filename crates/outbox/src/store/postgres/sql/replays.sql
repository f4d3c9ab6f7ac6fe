SELECT id, at, requested_by, reason, action, selection, count
FROM {s}.replays ORDER BY id DESC LIMIT $1
