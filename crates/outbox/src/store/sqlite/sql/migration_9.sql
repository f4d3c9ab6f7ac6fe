-- Migration 9: from this version a claim keeps a row's status and available_at and is told
-- by its token and lease (a claim writes no column an index reads). The version makes
-- earlier builds, which would not see those leases, refuse the file. Rows claimed before
-- keep status 1 and are read the same way. No table changes.
SELECT 1;
