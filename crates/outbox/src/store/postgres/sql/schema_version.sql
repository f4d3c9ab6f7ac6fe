SELECT coalesce(max(version), 0) FROM {s}.schema_migrations
