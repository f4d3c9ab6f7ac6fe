ALTER TABLE {s}.topic_pauses ADD COLUMN IF NOT EXISTS regex text;
