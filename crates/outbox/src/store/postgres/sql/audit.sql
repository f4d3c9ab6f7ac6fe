INSERT INTO {s}.replays (requested_by, reason, action, selection)
VALUES ($1, $2, $3, $4)
