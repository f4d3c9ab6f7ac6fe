SELECT kind, age_s, pid, usr, app, state, gid FROM (
      SELECT 'session'::text AS kind,
             extract(epoch FROM clock_timestamp() - xact_start)::float8 AS age_s,
             pid::int8 AS pid, usename::text AS usr,
             nullif(application_name, '')::text AS app, state::text AS state,
             NULL::text AS gid
      FROM pg_stat_activity
      WHERE datname = current_database() AND pid <> pg_backend_pid()
        AND xact_start IS NOT NULL
        AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
      UNION ALL
      SELECT 'prepared', extract(epoch FROM clock_timestamp() - prepared)::float8,
             NULL, owner::text, NULL, NULL, gid
      FROM pg_prepared_xacts WHERE database = current_database()
    ) h ORDER BY age_s DESC LIMIT 1
