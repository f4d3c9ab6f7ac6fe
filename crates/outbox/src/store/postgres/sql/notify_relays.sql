SELECT pg_notify('{s}_messages', '')
