-- The claim writes only columns no index reads (attempts, claimed_by, claim_token,
-- locked_until), so PostgreSQL can update a claimed row in place on its page (HOT, no
-- index entry) when the page has room for the new version: new pages keep half free.
-- Pages written before keep their rows as they are; their claims update as before until
-- those rows are gone.
ALTER TABLE {s}.messages SET (fillfactor = 50);
