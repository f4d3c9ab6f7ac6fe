//! Redaction of sink and database URLs: the one place that decides what of a URL may reach
//! a log line, an error message or [`Sink::describe`](crate::Sink::describe).
//!
//! What is hidden:
//! - the password of the userinfo (`scheme://user:PASSWORD@host`), shown as `***`; the user
//!   name, host, port and path are kept, so an operator can still tell destinations apart;
//! - the value of every query (and fragment) parameter whose name looks like it carries a
//!   secret ([`is_secret_parameter`]: `password`, `passwd`, `pwd`, `pass`, `token`,
//!   `secret`, `key`, `apikey`, `sig`, `signature`, `code`, `credential(s)`, and any dotted,
//!   dashed or underscored name with one of them as a part, such as `sasl.password`,
//!   `access_token` or `api-key`), shown as `***`.
//!
//! A URL the `url` crate parses is rewritten through it (WHATWG URL parsing: the last `@`
//! of the authority ends the userinfo, so a password with an unencoded `@` is still hidden
//! whole). Text that does not parse (a password with `/` or `#` in it, a broken IPv6
//! literal, no scheme at all) is redacted textually: everything between `://` and the last
//! `@` is treated as userinfo, and the query is scanned the same way. So is a URL whose
//! path contains `@` (most likely a user name with a `/` in it, `nats://tok/en@host`). Redacting an already
//! redacted URL changes nothing.

use percent_encoding::percent_decode_str;

/// The mask that replaces a secret.
pub const MASK: &str = "***";

/// `text` (a sink or database URL, or anything else) with its secrets replaced by
/// [`MASK`]; see the module docs for what counts as a secret. Never fails: text that is not
/// a URL is redacted textually, and text without secrets comes back unchanged (apart from
/// the `url` crate's normalisation of a parseable URL, e.g. a lower-case host).
pub fn redact_url(text: &str) -> String {
    match url::Url::parse(text) {
        // An `@` in the path is most likely a user name or password with a `/` in it
        // (`nats://tok/en@host`), not a path: redact textually (over-redacting is safe).
        Ok(mut u) if !u.cannot_be_a_base() && !u.path().contains('@') => {
            let mut changed = false;
            if u.password().is_some_and(|p| p != MASK) {
                // Cannot fail on a URL that has an authority (it has a password).
                let _ = u.set_password(Some(MASK));
                changed = true;
            }
            if let Some(q) = u.query().map(redact_pairs)
                && Some(q.as_str()) != u.query()
            {
                u.set_query(Some(&q));
                changed = true;
            }
            if let Some(f) = u.fragment().map(redact_pairs)
                && Some(f.as_str()) != u.fragment()
            {
                u.set_fragment(Some(&f));
                changed = true;
            }
            // Nothing secret: the text as given, not the `url` crate's normal form.
            if changed {
                u.to_string()
            } else {
                text.to_owned()
            }
        }
        _ => redact_text(text),
    }
}

/// As [`redact_url`], and without the query and fragment at all. For descriptions that
/// show options separately, and for URLs whose query belongs to someone else (a webhook
/// endpoint's parameters may be secrets under any name).
pub fn redact_url_without_query(text: &str) -> String {
    // The userinfo may contain `?` or `#`: cut only after its last `@`.
    let start = text.rfind('@').map_or(0, |at| at + 1);
    match text[start..].find(['?', '#']) {
        Some(i) => redact_url(&text[..start + i]),
        None => redact_url(text),
    }
}

/// `text` (for example a client library's error message) with every occurrence of `url`,
/// and of the password `url` carries (as written and percent-decoded, when at least 3
/// characters long), replaced by its redacted form. For messages from libraries that may
/// echo the URL they were given.
pub fn scrub(text: &str, url: &str) -> String {
    let mut out = if url.is_empty() {
        text.to_owned()
    } else {
        text.replace(url, &redact_url(url))
    };
    if let Some(pw) = password_of(url) {
        let decoded = percent_decode_str(&pw).decode_utf8_lossy().into_owned();
        for secret in [pw, decoded] {
            if secret.chars().count() >= 3 && secret != MASK {
                out = out.replace(&secret, MASK);
            }
        }
    }
    out
}

/// Does a query parameter named `name` carry a secret? True when the name (percent-decoded,
/// lower-cased) contains `password`, `passwd`, `secret` or `token`, or one of its parts
/// separated by `.`, `_` or `-` is `pass`, `pwd`, `key`, `apikey`, `sig`, `signature`,
/// `code`, `credential` or `credentials`.
pub fn is_secret_parameter(name: &str) -> bool {
    let name = percent_decode_str(&name.replace('+', " "))
        .decode_utf8_lossy()
        .to_lowercase();
    const CONTAINED: [&str; 4] = ["password", "passwd", "secret", "token"];
    const PARTS: [&str; 9] = [
        "pass",
        "pwd",
        "key",
        "apikey",
        "sig",
        "signature",
        "code",
        "credential",
        "credentials",
    ];
    CONTAINED.iter().any(|c| name.contains(c))
        || name
            .split(['.', '_', '-', ' '])
            .any(|part| PARTS.contains(&part))
}

/// The raw (still percent-encoded) password of `url`, if it has one.
fn password_of(url: &str) -> Option<String> {
    if let Ok(u) = url::Url::parse(url) {
        return u.password().map(str::to_owned);
    }
    let (_, rest) = url.split_once("://")?;
    let (userinfo, _) = rest.rsplit_once('@')?;
    userinfo.split_once(':').map(|(_, pw)| pw.to_owned())
}

/// `a=1&password=x` → `a=1&password=***` (pairs kept as written otherwise).
fn redact_pairs(query: &str) -> String {
    query
        .split('&')
        .map(|pair| {
            let name = pair.split_once('=').map_or(pair, |(k, _)| k);
            if is_secret_parameter(name) && pair.contains('=') {
                format!("{name}={MASK}")
            } else {
                pair.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The fallback for text the `url` crate cannot parse: everything between `://` and the
/// last `@` is userinfo (a password with `/`, `?` or `#` in it is what breaks parsing, so
/// the authority cannot be trusted to end at those), then the query is scanned.
fn redact_text(text: &str) -> String {
    let (prefix, rest) = match text.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((userinfo, host)) => {
                let user = match userinfo.split_once(':') {
                    Some((user, _)) => format!("{user}:{MASK}"),
                    None => MASK.to_owned(),
                };
                (format!("{scheme}://{user}@"), host)
            }
            None => (format!("{scheme}://"), rest),
        },
        None => (String::new(), text),
    };
    let mut out = prefix;
    match rest.split_once('?') {
        None => out.push_str(rest),
        Some((head, q)) => {
            out.push_str(head);
            out.push('?');
            // The query may run into a fragment; both are `&`-separated pairs here.
            match q.split_once('#') {
                Some((q, f)) => {
                    out.push_str(&redact_pairs(q));
                    out.push('#');
                    out.push_str(&redact_pairs(f));
                }
                None => out.push_str(&redact_pairs(q)),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked_and_the_rest_kept() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@127.0.0.1:5672/%2f?exchange=ev"),
            "amqp://guest:***@127.0.0.1:5672/%2f?exchange=ev"
        );
        assert_eq!(
            redact_url("postgres://app:pw@db.example.com:5432/shop"),
            "postgres://app:***@db.example.com:5432/shop"
        );
        assert_eq!(
            redact_url("redis://:pw@127.0.0.1:6379/3"),
            "redis://:***@127.0.0.1:6379/3"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(
            redact_url("postgres://postgres@127.0.0.1/test"),
            "postgres://postgres@127.0.0.1/test"
        );
        assert_eq!(redact_url("sqlite://outbox.db"), "sqlite://outbox.db");
    }

    #[test]
    fn tricky_passwords_never_show() {
        // An unencoded `@` and `:` in the password: the last `@` ends the userinfo.
        let r = redact_url("amqp://user:p@ss:w@rd@broker:5672/vhost");
        assert_eq!(r, "amqp://user:***@broker:5672/vhost");
        // Percent-encoded.
        let r = redact_url("mqtt://us%40er:p%3Ass%2Fw@broker:1883");
        assert_eq!(r, "mqtt://us%40er:***@broker:1883");
        // IPv6 host.
        let r = redact_url("nats://u:hunter22@[::1]:4222");
        assert_eq!(r, "nats://u:***@[::1]:4222");
        // A `/` and `#` in the password make it unparseable: redacted textually.
        let r = redact_url("redis://u:pa/ss#word@h:6379/0");
        assert_eq!(r, "redis://u:***@h:6379/0");
        assert!(!r.contains("pa/ss"));
        // A broken IPv6 literal.
        let r = redact_url("http://u:topsecret@[bad/x?token=abc&a=1");
        assert!(!r.contains("topsecret") && !r.contains("abc"), "{r}");
        assert!(r.ends_with("?token=***&a=1"), "{r}");
        // Redacting twice changes nothing.
        let once = redact_url("amqp://user:p@ss@broker/v?password=x");
        assert_eq!(redact_url(&once), once);
    }

    #[test]
    fn secret_query_parameters_are_masked() {
        assert_eq!(
            redact_url("kafka://b1:9092?sasl.password=pw&message_timeout_ms=5"),
            "kafka://b1:9092?sasl.password=***&message_timeout_ms=5"
        );
        assert_eq!(
            redact_url("https://hooks.example.com/in?access_token=abc&x=1#sig=zz"),
            "https://hooks.example.com/in?access_token=***&x=1#sig=***"
        );
        assert_eq!(
            redact_url("postgres://h/db?sslmode=require&password=pw"),
            "postgres://h/db?sslmode=require&password=***"
        );
        for secret in [
            "password",
            "PASSWORD",
            "sasl.password",
            "token",
            "api_key",
            "api-key",
            "apikey",
            "key",
            "secret",
            "client_secret",
            "sig",
            "X-Amz-Signature",
            "code",
            "pwd",
            "pass%77ord",
        ] {
            assert!(is_secret_parameter(secret), "{secret}");
        }
        for plain in [
            "exchange",
            "maxlen",
            "qos",
            "client_id",
            "heartbeat",
            "max_message_bytes",
            "auth_mechanism",
            "keep_alive",
            "sslmode",
        ] {
            assert!(!is_secret_parameter(plain), "{plain}");
        }
    }

    #[test]
    fn database_tls_parameters_are_kept() {
        // File paths, not secrets: an operator sees which CA and mode a store uses.
        assert_eq!(
            redact_url(
                "postgres://app:pw@db.example.com/shop?sslmode=verify-full\
                 &sslrootcert=/etc/ssl/db-ca.pem&sslcert=/run/c.pem&sslkey=/run/c.key"
            ),
            "postgres://app:***@db.example.com/shop?sslmode=verify-full\
             &sslrootcert=/etc/ssl/db-ca.pem&sslcert=/run/c.pem&sslkey=/run/c.key"
        );
        // `ssl-key` has `key` as a part, so it is masked like the sinks' `key=`.
        assert_eq!(
            redact_url(
                "mysql://app:pw@db:3306/shop?ssl-mode=VERIFY_IDENTITY&ssl-ca=/etc/ca.pem\
                 &ssl-cert=/run/c.pem&ssl-key=/run/c.key"
            ),
            "mysql://app:***@db:3306/shop?ssl-mode=VERIFY_IDENTITY&ssl-ca=/etc/ca.pem\
             &ssl-cert=/run/c.pem&ssl-key=***"
        );
    }

    #[test]
    fn unparseable_text_is_redacted_textually() {
        assert_eq!(redact_url("stdout"), "stdout");
        assert_eq!(redact_url(""), "");
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(redact_url("file:/tmp/out.jsonl"), "file:/tmp/out.jsonl");
        assert_eq!(redact_url("http://h"), "http://h");
        // A `?` in the password.
        let r = redact_url("redis://u:pa?ss@h:6379");
        assert_eq!(r, "redis://u:***@h:6379");
        // A `/` in a user name: parsed as a path by the `url` crate; no user name to keep.
        assert_eq!(redact_url("nats://to/ken@h:4222"), "nats://***@h:4222");
        assert_eq!(
            redact_url("weird://u:pw@@h:99999/p?token=1"),
            "weird://u:***@h:99999/p?token=***"
        );
    }

    #[test]
    fn queries_can_be_dropped() {
        assert_eq!(
            redact_url_without_query("https://user:pw@hooks.example.com:8443/in?code=abc#x"),
            "https://user:***@hooks.example.com:8443/in"
        );
        assert_eq!(redact_url_without_query("http://h/p"), "http://h/p");
        assert_eq!(
            redact_url_without_query("mqtt://u:p?w#d@h:1883?client_id=x"),
            "mqtt://u:***@h:1883"
        );
    }

    #[test]
    fn scrub_hides_the_url_and_its_password_in_other_text() {
        let url = "amqp://relay:Secr%40t-7f3a@127.0.0.1:5672/%2f";
        let text = format!("cannot connect to {url}: auth failed for password Secr@t-7f3a");
        let s = scrub(&text, url);
        assert!(!s.contains("Secr"), "{s}");
        assert!(s.contains("amqp://relay:***@127.0.0.1:5672/%2f"), "{s}");
        assert_eq!(scrub("nothing here", "nats://h:1"), "nothing here");
    }
}
