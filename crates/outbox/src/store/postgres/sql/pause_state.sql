SELECT c.paused, c.reason, c.changed_at,
       coalesce((SELECT json_agg(json_build_array(pattern, reason, paused_by,
                                 floor(extract(epoch FROM paused_at) * 1000)::bigint)
                                 ORDER BY pattern)
                 FROM {s}.topic_pauses), '[]')::text
FROM {s}.control c WHERE c.id
