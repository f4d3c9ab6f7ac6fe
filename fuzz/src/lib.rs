//! What the fuzz targets share: one readable input format, so that a seed is what a sink
//! wrote and a crash file can be read by eye.
//!
//! An input is header lines, a blank line, then the body:
//!
//! ```text
//! message-id: 0190…
//! topic: orders.created
//!
//! {"id":1}
//! ```
//!
//! A header line is `name: value` (split at the first `": "`, or the first `:`); a line
//! without a colon is a name with an empty value. Without a blank line, everything is
//! headers and the body is empty. Names and values are bytes: a target that needs text
//! skips the pairs that are not UTF-8, or hands the bytes on where the decoder takes bytes.

/// The header pairs and the body of `data`.
pub fn split(data: &[u8]) -> (Vec<(&[u8], &[u8])>, &[u8]) {
    let (head, body) = match find(data, b"\n\n") {
        Some(i) => (&data[..i], &data[i + 2..]),
        None => (data, &data[data.len()..]),
    };
    let pairs = head
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|line| match find(line, b": ") {
            Some(i) => (&line[..i], &line[i + 2..]),
            None => match line.iter().position(|b| *b == b':') {
                Some(i) => (&line[..i], &line[i + 1..]),
                None => (line, &line[line.len()..]),
            },
        })
        .collect();
    (pairs, body)
}

/// The pairs whose name and value are both UTF-8.
pub fn text_pairs<'a>(pairs: &[(&'a [u8], &'a [u8])]) -> Vec<(&'a str, &'a str)> {
    pairs
        .iter()
        .filter_map(|(n, v)| Some((std::str::from_utf8(n).ok()?, std::str::from_utf8(v).ok()?)))
        .collect()
}

/// An HTTP header map of the pairs `http` accepts (others are skipped, as a server would
/// have refused them before a handler saw them); repeated names are appended.
pub fn header_map(pairs: &[(&[u8], &[u8])]) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    for (n, v) in pairs {
        let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(n),
            http::HeaderValue::from_bytes(v),
        ) else {
            continue;
        };
        map.append(name, value);
    }
    map
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
