SELECT greatest(a.x, p.x, s.x)::int8, s.slot_name::text, s.x FROM
  (SELECT max(greatest(age(backend_xmin), age(backend_xid)))::int8 AS x
   FROM pg_stat_activity
   WHERE datname = current_database() AND pid <> pg_backend_pid()) a
  CROSS JOIN (SELECT max(age(transaction))::int8 AS x FROM pg_prepared_xacts
              WHERE database = current_database()) p
  LEFT JOIN (SELECT slot_name, age(xmin)::int8 AS x FROM pg_replication_slots
             WHERE xmin IS NOT NULL ORDER BY age(xmin) DESC LIMIT 1) s ON true
