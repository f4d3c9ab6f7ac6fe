//! `envelope::from_json_line`: one line of the `stdout` / `file:` sink, as raw bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = outbox::envelope::from_json_line(data);
});
