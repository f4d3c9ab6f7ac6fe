-- The consumer inbox: one row per (consumer, message id) a consumer accepted, written in
-- the consumer's own transaction; the purge reads it by age.
CREATE TABLE IF NOT EXISTS {s}.inbox (
    consumer    text NOT NULL CHECK (consumer <> '' AND octet_length(consumer) <= 255),
    message_id  uuid NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS inbox_received ON {s}.inbox (received_at);

-- Accept from any language, inside the consumer's transaction: true the first time this
-- consumer sees message_id, false for a duplicate. Insert first under the primary key; a
-- duplicate raises nothing, so the transaction stays usable.
CREATE OR REPLACE FUNCTION {s}.inbox_accept(consumer text, message_id uuid)
RETURNS boolean LANGUAGE plpgsql AS $fn$
DECLARE
    n bigint;
BEGIN
    IF inbox_accept.consumer IS NULL OR inbox_accept.consumer = ''
       OR octet_length(inbox_accept.consumer) > 255 OR inbox_accept.consumer ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION '{s}.inbox_accept: consumer must be 1-255 bytes without control characters, got %', quote_nullable(inbox_accept.consumer)
            USING ERRCODE = '22023';
    END IF;
    IF inbox_accept.message_id IS NULL THEN
        RAISE EXCEPTION '{s}.inbox_accept: message_id must not be NULL' USING ERRCODE = '22023';
    END IF;
    INSERT INTO {s}.inbox AS i (consumer, message_id)
    VALUES (inbox_accept.consumer, inbox_accept.message_id)
    ON CONFLICT ON CONSTRAINT inbox_pkey DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n > 0;
END
$fn$;
