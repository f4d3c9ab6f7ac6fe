//! `cloudevents::from_binary` on every binding (HTTP, Kafka, AMQP, MQTT, NATS), with the
//! `content-type` pair (if any) as the content type, and `is_binary` on the names.
#![no_main]
use libfuzzer_sys::fuzz_target;
use outbox::cloudevents::{Binding, from_binary, is_binary};

fuzz_target!(|data: &[u8]| {
    let (pairs, body) = outbox_fuzz::split(data);
    let pairs: Vec<(&str, &[u8])> = pairs
        .iter()
        .filter_map(|(n, v)| Some((std::str::from_utf8(n).ok()?, *v)))
        .collect();
    let content_type = pairs
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        .and_then(|(_, v)| std::str::from_utf8(v).ok());
    for binding in [
        Binding::Http,
        Binding::Kafka,
        Binding::Amqp,
        Binding::Mqtt,
        Binding::Nats,
    ] {
        let _ = is_binary(binding, pairs.iter().map(|(n, _)| *n));
        let _ = from_binary(
            binding,
            pairs.iter().copied(),
            content_type,
            bytes::Bytes::copy_from_slice(body),
        );
    }
});
