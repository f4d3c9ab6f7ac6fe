//! `webhook::WebhookSecret::parse` and `verify`. The lines before the first blank line
//! are, in order and raw: the secret's text, `webhook-id`, `webhook-timestamp`,
//! `webhook-signature` (missing lines are empty); the rest is the signed body. Checked
//! too: what `sign` produces verifies, and a body one byte longer does not.
#![no_main]
use libfuzzer_sys::fuzz_target;
use outbox::webhook::WebhookSecret;

/// The receiver's clock: the reference test vector's timestamp.
const NOW: i64 = 1_614_265_330;

fuzz_target!(|data: &[u8]| {
    let (head, body) = match data.windows(2).position(|w| w == b"\n\n") {
        Some(i) => (&data[..i], &data[i + 2..]),
        None => (data, &data[data.len()..]),
    };
    let lines: Vec<String> = head
        .split(|b| *b == b'\n')
        .map(|l| String::from_utf8_lossy(l).into_owned())
        .collect();
    let line = |i: usize| lines.get(i).cloned().unwrap_or_default();
    let (text, id, timestamp, signatures) = (line(0), line(1), line(2), line(3));
    let secret = match WebhookSecret::parse(&text, "fuzz") {
        Ok(s) => s,
        Err(_) => WebhookSecret::from_bytes(text.clone().into_bytes()),
    };
    let _ = secret.verify(&id, &timestamp, &signatures, body, NOW);
    let signature = secret.sign(&id, NOW, body);
    let verdict = secret.verify(&id, &NOW.to_string(), &signature, body, NOW);
    if text.is_empty() {
        assert!(verdict.is_err(), "an empty key verified");
    } else {
        assert_eq!(verdict, Ok(()), "a signature of its own did not verify");
        let mut longer = body.to_vec();
        longer.push(b'x');
        assert!(
            secret
                .verify(&id, &NOW.to_string(), &signature, &longer, NOW)
                .is_err(),
            "a signature verified a different body"
        );
    }
});
