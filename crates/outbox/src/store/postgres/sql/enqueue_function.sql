-- Enqueue from any language, inside the caller's transaction. Idempotent on message_id:
-- a duplicate returns the existing row's id and does not abort the transaction.
CREATE OR REPLACE FUNCTION {s}.enqueue(
    topic text,
    payload bytea,
    key text DEFAULT NULL,
    message_id uuid DEFAULT NULL,
    headers jsonb DEFAULT '{}',
    available_at timestamptz DEFAULT NULL
) RETURNS bigint LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    mid uuid := coalesce(enqueue.message_id, {s}.uuid_v7());
    hdr jsonb := coalesce(enqueue.headers, '{}'::jsonb);
    lim integer;
    size bigint;
    hsize bigint := 0;
    new_id bigint;
BEGIN
    IF enqueue.topic IS NULL OR enqueue.topic = '' OR octet_length(enqueue.topic) > 255
       OR enqueue.topic ~ '[[:space:][:cntrl:]*>]' THEN
        RAISE EXCEPTION '{s}.enqueue: topic must be 1-255 bytes without whitespace, control characters or wildcards (* >), got %', quote_nullable(enqueue.topic)
            USING ERRCODE = '22023';
    END IF;
    IF enqueue.payload IS NULL THEN
        RAISE EXCEPTION '{s}.enqueue: payload must not be NULL (use an empty bytea)' USING ERRCODE = '22023';
    END IF;
    -- The header checks and their size only when there are headers (most messages have
    -- none): three subqueries over an empty object, otherwise run on every call.
    IF hdr <> '{}'::jsonb THEN
        IF jsonb_typeof(hdr) <> 'object'
           OR EXISTS (SELECT 1 FROM jsonb_each(hdr) h WHERE jsonb_typeof(h.value) <> 'string') THEN
            RAISE EXCEPTION '{s}.enqueue: headers must be a JSON object of strings' USING ERRCODE = '22023';
        END IF;
        IF EXISTS (SELECT 1 FROM jsonb_object_keys(hdr) k
                   WHERE k !~ '^[A-Za-z0-9!#$%&''*+.^_`|~-]{1,255}$') THEN
            RAISE EXCEPTION '{s}.enqueue: header names must be 1-255 characters of A-Z a-z 0-9 and !#$%%&''*+-.^_`|~'
                USING ERRCODE = '22023';
        END IF;
        IF hdr ?| ARRAY['message-id', 'topic', 'key', 'occurred-at'] THEN
            RAISE EXCEPTION '{s}.enqueue: headers message-id, topic, key and occurred-at are reserved (they come from the message itself)'
                USING ERRCODE = '22023';
        END IF;
        hsize := coalesce((SELECT sum(octet_length(h.key) + octet_length(h.value))
                           FROM jsonb_each_text(hdr) h), 0);
    END IF;
    SELECT c.max_message_bytes INTO lim FROM {s}.control c WHERE c.id;
    size := octet_length(enqueue.payload) + octet_length(enqueue.topic)
          + coalesce(octet_length(enqueue.key), 0) + hsize;
    IF size > lim THEN
        RAISE EXCEPTION '{s}.enqueue: message too large: % bytes exceed the limit of % bytes', size, lim
            USING ERRCODE = '54000';
    END IF;
    INSERT INTO {s}.messages AS m (message_id, topic, key, payload, headers, available_at)
    VALUES (mid, enqueue.topic, enqueue.key, enqueue.payload, hdr, coalesce(enqueue.available_at, now()))
    ON CONFLICT (message_id) DO NOTHING
    RETURNING m.id INTO new_id;
    IF new_id IS NULL THEN
        SELECT m.id INTO new_id FROM {s}.messages m WHERE m.message_id = mid;
    END IF;
    RETURN new_id;
END
$fn$;
