-- Migration 8: the SQL entry point takes the id's inbox lock (`inbox_lock_name`).
-- `{p}_inbox_accept` as in migration 4, inserting under the id's inbox lock (`{lock}`, the
-- lock name of `inbox_lock_name`); an error in the insert releases the lock and is raised
-- again.

-- @run
DROP PROCEDURE IF EXISTS {p}_inbox_accept
-- @run
CREATE PROCEDURE {p}_inbox_accept(
   IN p_consumer TEXT CHARACTER SET utf8mb4, IN p_message_id VARCHAR(64) CHARACTER SET ascii)
BEGIN
   DECLARE v_lock VARCHAR(64);
   DECLARE v_fresh BIGINT;
   IF p_consumer IS NULL OR OCTET_LENGTH(p_consumer) = 0 OR OCTET_LENGTH(p_consumer) > 255
      OR p_consumer REGEXP '[[:cntrl:]]' THEN
       SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_inbox_accept: consumer must be 1-255 bytes without control characters';
   END IF;
   IF p_message_id IS NULL OR NOT (p_message_id REGEXP '^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$') THEN
       SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_inbox_accept: message_id must be a UUID (8-4-4-4-12 hex digits)';
   END IF;
   SET v_lock = {lock};
   IF COALESCE(GET_LOCK(v_lock, @@innodb_lock_wait_timeout), 0) <> 1 THEN
       SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = 1205, MESSAGE_TEXT = '{p}_inbox_accept: lock wait timeout on the message id';
   END IF;
   BEGIN
       DECLARE EXIT HANDLER FOR SQLEXCEPTION
       BEGIN
           DO RELEASE_LOCK(v_lock);
           RESIGNAL;
       END;
       INSERT IGNORE INTO {p}_inbox (consumer, message_id)
       VALUES (CONVERT(p_consumer USING binary), LOWER(p_message_id));
       SET v_fresh = ROW_COUNT();
   END;
   DO RELEASE_LOCK(v_lock);
   SELECT v_fresh AS fresh;
END
