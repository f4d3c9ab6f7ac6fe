-- Migration 5: a topic pause carries its pattern's regex (`TopicPattern::regex`), so the
-- claim matches topics against it; `migrate` fills it for pauses made before. Guarded, as
-- v3 is, so an interrupted run can be rerun.

-- @unless_column {p}_topic_pauses regex
ALTER TABLE {p}_topic_pauses ADD COLUMN regex TEXT NULL
