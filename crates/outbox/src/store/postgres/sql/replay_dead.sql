UPDATE {s}.messages m
    SET status = 0, attempts = 0, replay_id = $3,
        available_at = now() + x.delay_ms * interval '1 millisecond',
        claim_token = NULL, locked_until = NULL, dispatched_at = NULL
    FROM unnest($1::bigint[], $2::bigint[]) AS x(id, delay_ms)
    WHERE m.id = x.id AND m.status = 3
