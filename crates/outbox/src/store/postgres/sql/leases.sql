SELECT count(*), max(available_at),
       ceil(extract(epoch FROM max(available_at) - now()) * 1000)::bigint
FROM {s}.messages WHERE status = 1 AND available_at > now()
