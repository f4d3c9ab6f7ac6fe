-- Migration 2: `{p}_enqueue` refuses what PostgreSQL's `outbox.enqueue` refuses, in the
-- producer's transaction, with the same SQLSTATEs: headers that are not a JSON object of
-- strings (a null or number value included), header names that are not 1-255 byte HTTP
-- tokens (compared as bytes, so no case folding lets a non-ASCII letter through), the
-- reserved names (exact, case-sensitive), all `22023`; a message over the limit `54000`,
-- its size counted as everywhere else (payload + topic + key + header names and values).
-- The header values are read as the `$.*` array, so no header name is ever spliced into
-- a JSON path.

-- @run
DROP PROCEDURE IF EXISTS {p}_enqueue
-- @run
CREATE PROCEDURE {p}_enqueue(
   IN p_topic VARCHAR(255), IN p_payload LONGBLOB, IN p_key VARCHAR(1024),
   IN p_message_id CHAR(36), IN p_headers LONGTEXT)
BEGIN
   DECLARE v_headers LONGTEXT CHARACTER SET utf8mb4 DEFAULT COALESCE(p_headers, '{}');
   DECLARE v_id CHAR(36) DEFAULT LOWER(p_message_id);
   DECLARE v_limit BIGINT;
   DECLARE v_size BIGINT;
   DECLARE v_names LONGTEXT CHARACTER SET utf8mb4;
   DECLARE v_values LONGTEXT CHARACTER SET utf8mb4;
   DECLARE v_name LONGTEXT CHARACTER SET utf8mb4;
   DECLARE v_value LONGTEXT CHARACTER SET utf8mb4;
   DECLARE v_header_bytes BIGINT DEFAULT 0;
   DECLARE v_i BIGINT DEFAULT 0;
   DECLARE v_msg VARCHAR(128) CHARACTER SET utf8mb4;
   IF p_topic IS NULL OR p_topic = '' OR OCTET_LENGTH(p_topic) > 255
      OR p_topic REGEXP '[[:space:][:cntrl:]*>]' THEN
       SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: topic must be 1-255 bytes without whitespace, control characters or wildcards (* >)';
   END IF;
   IF p_payload IS NULL THEN
       SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: payload must not be NULL (use an empty string)';
   END IF;
   IF JSON_VALID(v_headers) = 0 OR JSON_TYPE(v_headers) <> 'OBJECT' THEN
       SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: headers must be a JSON object of strings';
   END IF;
   SET v_values = COALESCE(JSON_EXTRACT(v_headers, '$.*'), '[]');
   WHILE v_i < JSON_LENGTH(v_values) DO
       SET v_value = JSON_EXTRACT(v_values, CONCAT('$[', v_i, ']'));
       IF JSON_TYPE(v_value) <> 'STRING' THEN
           SET v_msg = LEFT(CONCAT('{p}_enqueue: headers must be a JSON object of strings (a value is a JSON ', LOWER(JSON_TYPE(v_value)), ')'), 128);
           SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_msg;
       END IF;
       SET v_header_bytes = v_header_bytes + OCTET_LENGTH(JSON_UNQUOTE(v_value));
       SET v_i = v_i + 1;
   END WHILE;
   SET v_names = JSON_KEYS(v_headers);
   SET v_i = 0;
   WHILE v_i < JSON_LENGTH(v_names) DO
       SET v_name = JSON_UNQUOTE(JSON_EXTRACT(v_names, CONCAT('$[', v_i, ']')));
       IF NOT (CAST(v_name AS BINARY) REGEXP '^[A-Za-z0-9!#$%&''*+.^_`|~-]{1,255}$') THEN
           SET v_msg = LEFT(CONCAT('{p}_enqueue: header name ', QUOTE(LEFT(v_name, 40)), ' is not 1-255 characters of A-Z a-z 0-9 !#$%&''*+-.^_`|~'), 128);
           SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_msg;
       END IF;
       IF CAST(v_name AS BINARY) IN ('message-id', 'topic', 'key', 'occurred-at') THEN
           SET v_msg = LEFT(CONCAT('{p}_enqueue: header ', v_name, ' is reserved (message-id, topic, key and occurred-at come from the message)'), 128);
           SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_msg;
       END IF;
       SET v_header_bytes = v_header_bytes + OCTET_LENGTH(v_name);
       SET v_i = v_i + 1;
   END WHILE;
   IF v_id IS NULL THEN
       SET v_id = {uuid};
   END IF;
   SELECT max_message_bytes INTO v_limit FROM {p}_control WHERE id = 1;
   SET v_size = OCTET_LENGTH(p_payload) + OCTET_LENGTH(p_topic)
              + COALESCE(OCTET_LENGTH(p_key), 0) + v_header_bytes;
   IF v_size > v_limit THEN
       SET v_msg = LEFT(CONCAT('{p}_enqueue: message too large: ', v_size, ' bytes exceed the limit of ', v_limit, ' bytes'), 128);
       SIGNAL SQLSTATE '54000' SET MESSAGE_TEXT = v_msg;
   END IF;
   INSERT INTO {p}_messages (message_id, topic, `key`, payload, headers)
   VALUES (v_id, p_topic, p_key, p_payload, v_headers)
   ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id);
   SELECT LAST_INSERT_ID() AS id;
END
