SELECT count(*), max(locked_until),
       ceil(extract(epoch FROM max(locked_until) - now()) * 1000)::bigint
FROM {s}.messages WHERE status <= 1 AND claim_token IS NOT NULL AND locked_until > now()
