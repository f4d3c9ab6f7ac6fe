LOWER(CONCAT(
    SUBSTR(LPAD(HEX(FLOOR(UNIX_TIMESTAMP(NOW(6)) * 1000)), 12, '0'), 1, 8), '-',
    SUBSTR(LPAD(HEX(FLOOR(UNIX_TIMESTAMP(NOW(6)) * 1000)), 12, '0'), 9, 4), '-7',
    SUBSTR(@outbox_r := MD5(CONCAT(RAND(), UUID())), 1, 3), '-',
    HEX(8 | (CONV(SUBSTR(@outbox_r, 4, 1), 16, 10) & 3)), SUBSTR(@outbox_r, 5, 3), '-',
    SUBSTR(@outbox_r, 8, 12)))
