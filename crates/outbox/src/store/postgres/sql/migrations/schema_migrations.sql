CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
    version bigint PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now());
