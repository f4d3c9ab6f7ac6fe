-- Migration 1: the messages table (the live index on the stored generated column
-- `live_at`), the control row, and `{prefix}_enqueue(topic, payload, key, message_id,
-- headers)` for producers in other languages.

-- @run
CREATE TABLE IF NOT EXISTS {p}_messages (
    id            BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    message_id    CHAR(36) CHARACTER SET ascii NOT NULL,
    topic         VARCHAR(255) NOT NULL,
    `key`         VARCHAR(1024),
    payload       LONGBLOB NOT NULL,
    headers       LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL CHECK (JSON_VALID(headers)),
    occurred_at   DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    available_at  DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    status        TINYINT NOT NULL DEFAULT 0 CHECK (status BETWEEN 0 AND 3),
    attempts      INT NOT NULL DEFAULT 0,
    claimed_by    VARCHAR(255),
    claim_token   CHAR(36) CHARACTER SET ascii,
    locked_until  DATETIME(6),
    dispatched_at DATETIME(6),
    last_error    TEXT,
    live_at       DATETIME(6) GENERATED ALWAYS AS (CASE WHEN status <= 1 THEN available_at END) STORED,
    UNIQUE KEY {p}_messages_message_id (message_id),
    KEY {p}_messages_live (live_at, id),
    KEY {p}_messages_dispatched (status, dispatched_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin
-- @run
CREATE TABLE IF NOT EXISTS {p}_control (
    id                TINYINT NOT NULL PRIMARY KEY CHECK (id = 1),
    paused            BOOLEAN NOT NULL DEFAULT FALSE,
    reason            TEXT,
    changed_at        DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    max_message_bytes BIGINT NOT NULL DEFAULT 4194304
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4
-- @run
INSERT IGNORE INTO {p}_control (id) VALUES (1)
-- @run
DROP PROCEDURE IF EXISTS {p}_enqueue
-- @run
CREATE PROCEDURE {p}_enqueue(
   IN p_topic VARCHAR(255), IN p_payload LONGBLOB, IN p_key VARCHAR(1024),
   IN p_message_id CHAR(36), IN p_headers LONGTEXT)
BEGIN
   DECLARE v_headers LONGTEXT DEFAULT COALESCE(p_headers, '{}');
   DECLARE v_id CHAR(36) DEFAULT LOWER(p_message_id);
   DECLARE v_limit BIGINT;
   DECLARE v_size BIGINT;
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
   IF JSON_CONTAINS_PATH(v_headers, 'one', '$."message-id"', '$.topic', '$.key', '$."occurred-at"') THEN
       SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: headers message-id, topic, key and occurred-at are reserved';
   END IF;
   IF v_id IS NULL THEN
       SET v_id = {uuid};
   END IF;
   SELECT max_message_bytes INTO v_limit FROM {p}_control WHERE id = 1;
   SET v_size = OCTET_LENGTH(p_payload) + OCTET_LENGTH(p_topic)
              + COALESCE(OCTET_LENGTH(p_key), 0) + OCTET_LENGTH(v_headers);
   IF v_size > v_limit THEN
       SIGNAL SQLSTATE '22001' SET MESSAGE_TEXT = '{p}_enqueue: message too large for max_message_bytes';
   END IF;
   INSERT INTO {p}_messages (message_id, topic, `key`, payload, headers)
   VALUES (v_id, p_topic, p_key, p_payload, v_headers)
   ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id);
   SELECT LAST_INSERT_ID() AS id;
END
