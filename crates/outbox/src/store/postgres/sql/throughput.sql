SELECT m, sum(d)::bigint, sum(x)::bigint FROM (
  SELECT floor(extract(epoch FROM now() - dispatched_at) / 60)::bigint AS m,
         1 AS d, 0 AS x
  FROM {s}.messages
  WHERE status = 2 AND dispatched_at >= now() - $1 * interval '1 minute'
  UNION ALL
  SELECT floor(extract(epoch FROM now() - available_at) / 60)::bigint, 0, 1
  FROM {s}.messages
  WHERE status = 3 AND available_at >= now() - $1 * interval '1 minute'
) t GROUP BY m
