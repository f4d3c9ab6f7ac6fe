//! `envelope::from_headers`: header pairs (bytes) and a payload, the generic decoder.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (pairs, body) = outbox_fuzz::split(data);
    let pairs: Vec<(&str, &[u8])> = pairs
        .iter()
        .filter_map(|(n, v)| Some((std::str::from_utf8(n).ok()?, *v)))
        .collect();
    let _ = outbox::envelope::from_headers(pairs, bytes::Bytes::copy_from_slice(body));
});
