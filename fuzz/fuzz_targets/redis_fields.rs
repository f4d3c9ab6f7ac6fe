//! `envelope::from_redis`: a stream entry whose fields are the input's header pairs (a
//! value starting with `#` is an integer, as a non-string field), the body the `payload`
//! field unless one is given.
#![no_main]
use libfuzzer_sys::fuzz_target;
use redis::Value;
use redis::streams::StreamId;

fuzz_target!(|data: &[u8]| {
    let (pairs, body) = outbox_fuzz::split(data);
    let mut entry = StreamId::default();
    entry.id = "1-0".into();
    for (name, value) in pairs {
        let Ok(name) = std::str::from_utf8(name) else {
            continue;
        };
        let value = match value.strip_prefix(b"#") {
            Some(n) => Value::Int(n.len() as i64),
            None => Value::BulkString(value.to_vec()),
        };
        entry.map.insert(name.to_owned(), value);
    }
    entry
        .map
        .entry("payload".into())
        .or_insert_with(|| Value::BulkString(body.to_vec()));
    let _ = outbox::envelope::from_redis(&entry);
});
