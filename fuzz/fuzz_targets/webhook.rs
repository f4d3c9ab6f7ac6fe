//! `envelope::from_webhook` (outbox and CloudEvents forms of the HTTP binding) over a
//! `HeaderMap` built from the input, and `from_verified_webhook` under a fixed key.
#![no_main]
use libfuzzer_sys::fuzz_target;
use outbox::webhook::WebhookSecret;

fuzz_target!(|data: &[u8]| {
    let (pairs, body) = outbox_fuzz::split(data);
    let headers = outbox_fuzz::header_map(&pairs);
    let body = bytes::Bytes::copy_from_slice(body);
    let _ = outbox::envelope::from_webhook(&headers, body.clone());
    let secret = WebhookSecret::from_bytes(b"fuzz-key".to_vec());
    let _ = outbox::envelope::from_verified_webhook(&secret, &headers, body);
});
