UPDATE {s}.replays SET count = count + $1 WHERE id = $2
