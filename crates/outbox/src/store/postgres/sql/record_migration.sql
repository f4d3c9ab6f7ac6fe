INSERT INTO {s}.schema_migrations (version) VALUES ($1)
