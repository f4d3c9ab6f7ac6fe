//! `envelope::from_nats_headers`: an `async_nats::HeaderMap` built from the input (the
//! outbox envelope, `Nats-` headers skipped, repeated names, CloudEvents structured mode).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (pairs, body) = outbox_fuzz::split(data);
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in outbox_fuzz::text_pairs(&pairs) {
        // What a NATS client could have received: a name the protocol carries.
        let Ok(name) = name.parse::<async_nats::HeaderName>() else {
            continue;
        };
        let Ok(value) = value.parse::<async_nats::HeaderValue>() else {
            continue;
        };
        headers.append(name, value);
    }
    let _ = outbox::envelope::from_nats_headers(&headers, bytes::Bytes::copy_from_slice(body));
});
