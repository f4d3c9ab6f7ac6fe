-- Migration 4: the consumer inbox. `consumer` is `VARBINARY(255)`: compared as bytes, with
-- no trailing-space padding (`utf8mb4_bin` is `PAD SPACE` on MariaDB, where `'a'` and
-- `'a '` would collide), at most 255 bytes as everywhere else. `{p}_inbox_accept(consumer,
-- message_id)` is a procedure, not a function (a function that writes needs
-- `log_bin_trust_function_creators` or SUPER under binary logging); it returns one row,
-- column `fresh`: 1 the first time, 0 for a duplicate. Its checks `SIGNAL` SQLSTATE
-- `22023`, which rolls back that statement only, never the caller's transaction.

-- @run
CREATE TABLE IF NOT EXISTS {p}_inbox (
    consumer    VARBINARY(255) NOT NULL,
    message_id  CHAR(36) CHARACTER SET ascii NOT NULL,
    received_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, message_id),
    KEY {p}_inbox_received (received_at)
) ENGINE = InnoDB
-- @run
DROP PROCEDURE IF EXISTS {p}_inbox_accept
-- @run
CREATE PROCEDURE {p}_inbox_accept(
   IN p_consumer TEXT CHARACTER SET utf8mb4, IN p_message_id VARCHAR(64) CHARACTER SET ascii)
BEGIN
   IF p_consumer IS NULL OR OCTET_LENGTH(p_consumer) = 0 OR OCTET_LENGTH(p_consumer) > 255
      OR p_consumer REGEXP '[[:cntrl:]]' THEN
       SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_inbox_accept: consumer must be 1-255 bytes without control characters';
   END IF;
   IF p_message_id IS NULL OR NOT (p_message_id REGEXP '^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$') THEN
       SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_inbox_accept: message_id must be a UUID (8-4-4-4-12 hex digits)';
   END IF;
   INSERT IGNORE INTO {p}_inbox (consumer, message_id)
   VALUES (CONVERT(p_consumer USING binary), LOWER(p_message_id));
   SELECT ROW_COUNT() AS fresh;
END
