//! `cloudevents::from_structured`: a body in the JSON event format, as raw bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = outbox::cloudevents::from_structured(data);
});
