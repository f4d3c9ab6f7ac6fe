//! Redaction of sink and database URLs: the one place that decides what of a URL may reach
//! a log line, an error message or [`Sink::describe`](crate::Sink::describe).
//!
//! What is hidden:
//! - the password of the userinfo (`scheme://user:PASSWORD@host`), shown as `***`; the user
//!   name, host, port and path are kept, so an operator can still tell destinations apart;
//! - the value of every query (and fragment) parameter whose name looks like it carries a
//!   secret ([`is_secret_parameter`]: `password`, `passwd`, `pwd`, `pass`, `token`,
//!   `secret`, `key`, `apikey`, `sig`, `signature`, `code`, `credential(s)`, `oauthbearer`,
//!   `jaas`, and any dotted,
//!   dashed or underscored name with one of them as a part, such as `sasl.password`,
//!   `access_token` or `api-key`), shown as `***`.
//!
//! - for a web (`http`, `https`) URL, a webhook's destination, everything after the
//!   host and port: chat webhooks carry their secret in the path
//!   (`https://hooks.slack.com/services/T…/B…/SECRET`, `https://discord.com/api/webhooks/ID/TOKEN`,
//!   Teams' `…/webhookb2/…/IncomingWebhook/KEY/…`) and others in the query under any name.
//!   The path and query become `…#` and the first 8 hex digits of their SHA-256
//!   ([`WEB_PATH_MARK`]), so `https://hooks.slack.com/…#3f2a9c1b`: stable across runs and
//!   relays, different for different endpoints, and not reversible. A bare host
//!   (`https://h/`) is shown as is.
//!
//! A URL the `url` crate parses is rewritten through it (WHATWG URL parsing: the last `@`
//! of the authority ends the userinfo, so a password with an unencoded `@` is still hidden
//! whole). Text that does not parse (a password with `/` or `#` in it, a broken IPv6
//! literal, no scheme at all) is redacted textually: everything between `://` and the last
//! `@` is treated as userinfo, and the query is scanned the same way. So is a URL whose
//! path contains `@` (most likely a user name with a `/` in it, `nats://tok/en@host`). Redacting an already
//! redacted URL changes nothing.

use percent_encoding::percent_decode_str;
use sha2::Digest as _;

/// The mask that replaces a secret.
pub const MASK: &str = "***";

/// What replaces a web URL's path and query, before `#` and their short hash.
pub const WEB_PATH_MARK: &str = "…";

/// `text` (a sink or database URL, or anything else) with its secrets replaced by
/// [`MASK`]; see the module docs for what counts as a secret. Never fails: text that is not
/// a URL is redacted textually, and text without secrets comes back unchanged (apart from
/// the `url` crate's normalisation of a parseable URL, e.g. a lower-case host).
pub fn redact_url(text: &str) -> String {
    match url::Url::parse(text) {
        // The whole path is hashed, so an `@` in it (Teams' webhook paths have one) is no
        // reason to distrust the parse.
        Ok(u) if is_web(u.scheme()) && !u.cannot_be_a_base() => redact_web(&u),
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
///
/// A web (`http`, `https`) URL is shown as by [`redact_url`]: its query is part of the
/// hash that stands for its path.
pub fn redact_url_without_query(text: &str) -> String {
    if text
        .split_once("://")
        .is_some_and(|(scheme, _)| is_web(scheme))
    {
        return redact_url(text);
    }
    // The userinfo may contain `?` or `#`: cut only after its last `@`.
    let start = text.rfind('@').map_or(0, |at| at + 1);
    match text[start..].find(['?', '#']) {
        Some(i) => redact_url(&text[..start + i]),
        None => redact_url(text),
    }
}

/// As [`redact_url`], and the whole userinfo hidden, user name included, however the
/// scheme is written: for text whose kind is not known, such as a URL under a mistyped
/// scheme (`nat://TOKEN@host`, `nats+tls:/TOKEN@host`) or a route without its pattern,
/// where a user name may be a token (NATS's `nats://TOKEN@host`). Everything before the
/// last `@` after the scheme becomes [`MASK`].
pub fn redact_unknown_url(text: &str) -> String {
    let redacted = redact_url(text);
    let (scheme, rest) = match redacted.split_once(':') {
        Some((scheme, rest))
            if scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')) =>
        {
            (format!("{scheme}:"), rest)
        }
        _ => (String::new(), redacted.as_str()),
    };
    let body = rest.trim_start_matches('/');
    let slashes = &rest[..rest.len() - body.len()];
    match body.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}{slashes}{MASK}@{host}"),
        None => redacted.clone(),
    }
}

/// `text` (for example a client library's error message) with every occurrence of `url`,
/// of the password `url` carries and of the values of its secret query parameters
/// ([`is_secret_parameter`]; each as written and percent-decoded, when at least 3
/// characters long), replaced by its redacted form. For messages from libraries that may
/// echo the URL they were given.
pub fn scrub(text: &str, url: &str) -> String {
    let mut out = if url.is_empty() {
        text.to_owned()
    } else {
        text.replace(url, &redact_url(url))
    };
    let mut secrets: Vec<String> = password_of(url).into_iter().collect();
    // The values of secret-named query parameters, as written (a library may echo one).
    if let Some((_, query)) = url.split_once('?') {
        for pair in query.split(['&', '#']) {
            if let Some((name, value)) = pair.split_once('=')
                && is_secret_parameter(name)
            {
                secrets.push(value.to_owned());
            }
        }
    }
    for raw in secrets {
        let decoded = percent_decode_str(&raw.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned();
        for secret in [raw, decoded] {
            if secret.chars().count() >= 3 && secret != MASK {
                out = out.replace(&secret, MASK);
            }
        }
    }
    out
}

/// Does a query parameter named `name` carry a secret? True when the name (percent-decoded,
/// lower-cased) contains `password`, `passwd`, `secret`, `token`, `oauthbearer` or `jaas`,
/// or one of its parts
/// separated by `.`, `_` or `-` is `pass`, `pwd`, `key`, `apikey`, `sig`, `signature`,
/// `code`, `credential` or `credentials`.
pub fn is_secret_parameter(name: &str) -> bool {
    let name = percent_decode_str(&name.replace('+', " "))
        .decode_utf8_lossy()
        .to_lowercase();
    // `oauthbearer` (librdkafka's `sasl.oauthbearer.config` carries the unsecured JWT's
    // claims or a client secret) and `jaas` (a JAAS configuration with its password).
    const CONTAINED: [&str; 6] = [
        "password",
        "passwd",
        "secret",
        "token",
        "oauthbearer",
        "jaas",
    ];
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

/// `http` or `https`, in any case.
fn is_web(scheme: &str) -> bool {
    scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https")
}

/// `…#` and the first 8 hex digits of the SHA-256 of `rest` (a web URL's path and query).
fn web_mark(rest: &str) -> String {
    let digest = sha2::Sha256::digest(rest.as_bytes());
    let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("{WEB_PATH_MARK}#{hex}")
}

/// Is `rest` (what follows a web URL's authority) already [`web_mark`]'s form?
fn is_web_mark(rest: &str) -> bool {
    let rest = rest
        .strip_prefix("/%E2%80%A6#")
        .or_else(|| rest.strip_prefix("/…#"));
    rest.is_some_and(|h| h.len() == 8 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A parsed web URL: scheme, user name, masked password, host and port, then
/// [`web_mark`] of the path and query (the fragment is never sent, so it is dropped).
fn redact_web(u: &url::Url) -> String {
    let mut out = format!("{}://", u.scheme());
    if !u.username().is_empty() || u.password().is_some() {
        out.push_str(u.username());
        if u.password().is_some() {
            out.push(':');
            out.push_str(MASK);
        }
        out.push('@');
    }
    out.push_str(u.host_str().unwrap_or_default());
    if let Some(port) = u.port() {
        out.push_str(&format!(":{port}"));
    }
    let mut rest = u.path().to_owned();
    // An empty query (`…/in?`) is no query: the same endpoint, the same hash.
    if let Some(q) = u.query().filter(|q| !q.is_empty()) {
        rest.push('?');
        rest.push_str(q);
    }
    if let Some(f) = u.fragment()
        && u.query().is_none_or(str::is_empty)
        && is_web_mark(&format!("{}#{f}", u.path()))
    {
        // Already redacted: the same text again.
        out.push_str(&format!("/{WEB_PATH_MARK}#{f}"));
        return out;
    }
    out.push_str(&web_rest(&rest));
    out
}

/// `/` for an empty path and query, else `/` and [`web_mark`] of them.
fn web_rest(rest: &str) -> String {
    if rest.is_empty() || rest == "/" {
        "/".to_owned()
    } else if is_web_mark(rest) {
        rest.replace("%E2%80%A6", WEB_PATH_MARK)
    } else {
        format!("/{}", web_mark(rest))
    }
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
    if text.split_once("://").is_some_and(|(s, _)| is_web(s)) {
        // The host (and port) ends at the first `/`, `?` or `#`; the rest is hashed.
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (host, path) = rest.split_at(end);
        out.push_str(host);
        out.push_str(&web_rest(path));
        return out;
    }
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
        assert!(r.starts_with("http://u:***@[bad/…#"), "{r}");
        let r = redact_url("mqtt://u:topsecret@[bad/x?token=abc&a=1");
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
            redact_url("wss://broker.example.com/mqtt?access_token=abc&x=1#sig=zz"),
            "wss://broker.example.com/mqtt?access_token=***&x=1#sig=***"
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
        assert_eq!(redact_url("http://h"), "http://h/");
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
            redact_url_without_query("tcp://user:pw@broker.example.com:8443/in?code=abc#x"),
            "tcp://user:***@broker.example.com:8443/in"
        );
        // A web URL's query is part of the hash, as in `redact_url`.
        let r = redact_url_without_query("https://user:pw@hooks.example.com:8443/in?code=abc#x");
        assert_eq!(
            r,
            redact_url("https://user:pw@hooks.example.com:8443/in?code=abc")
        );
        assert!(
            r.starts_with("https://user:***@hooks.example.com:8443/…#"),
            "{r}"
        );
        assert_eq!(redact_url_without_query("http://h/"), "http://h/");
        assert_eq!(
            redact_url_without_query("mqtt://u:p?w#d@h:1883?client_id=x"),
            "mqtt://u:***@h:1883"
        );
    }

    /// The secret part of each chat webhook form, and the URL.
    const WEBHOOKS: [(&str, &str); 4] = [
        (
            "XXXXSECRET",
            "https://hooks.slack.com/services/T000/B000/XXXXSECRET",
        ),
        ("TOKEN", "https://discord.com/api/webhooks/123/TOKEN"),
        (
            "0123abcdKEY",
            "https://contoso.webhook.office.com/webhookb2/0a1b-guid@2c3d-guid/IncomingWebhook/0123abcdKEY/4e5f-guid",
        ),
        (
            "chat-key-XYZ",
            "https://chat.googleapis.com/v1/spaces/S/messages?key=chat-key-XYZ&token=t",
        ),
    ];

    #[test]
    fn webhook_paths_become_a_stable_short_hash() {
        for (secret, url) in WEBHOOKS {
            for r in [redact_url(url), redact_url_without_query(url)] {
                assert!(!r.contains(secret), "{url} -> {r}");
                let (head, hash) = r.split_once("/…#").unwrap_or_else(|| panic!("{r}"));
                assert!(url.starts_with(head), "{url} -> {r}");
                assert_eq!(head.matches('/').count(), 2, "only scheme://host: {r}");
                assert!(hash.len() == 8 && hash.bytes().all(|b| b.is_ascii_hexdigit()));
                // Stable, and idempotent.
                assert_eq!(redact_url(url), r);
                assert_eq!(redact_url(&r), r);
                assert_eq!(redact_url_without_query(&r), r);
            }
        }
        assert_eq!(
            redact_url("https://hooks.slack.com/services/T000/B000/XXXXSECRET"),
            format!(
                "https://hooks.slack.com/…#{}",
                &format!(
                    "{:x}",
                    sha2::Sha256::digest(b"/services/T000/B000/XXXXSECRET")
                )[..8]
            )
        );
        // Different endpoints on one host stay apart; the password is masked; the port kept.
        let a = redact_url("https://u:pw@hooks.example.com:8443/a");
        let b = redact_url("https://u:pw@hooks.example.com:8443/b");
        assert_ne!(a, b);
        assert!(
            a.starts_with("https://u:***@hooks.example.com:8443/…#"),
            "{a}"
        );
        // A bare host has nothing to hide; upper-case schemes are web URLs too.
        assert_eq!(
            redact_url("https://hooks.example.com"),
            "https://hooks.example.com/"
        );
        assert!(!redact_url("HTTPS://h/x/TOKEN").contains("TOKEN"));
        // Unparseable web URLs are cut at the host textually.
        let r = redact_url("https://u:p/w@hooks.slack.com/services/T/B/XXXXSECRET");
        assert!(r.starts_with("https://u:***@hooks.slack.com/…#"), "{r}");
        assert!(!r.contains("XXXXSECRET"), "{r}");
    }

    #[test]
    fn unknown_urls_hide_the_whole_userinfo() {
        for (url, shown) in [
            (
                "nat://user:TOKEN1@127.0.0.1:4222",
                "nat://***@127.0.0.1:4222",
            ),
            ("nat://TOKEN1@127.0.0.1:4222", "nat://***@127.0.0.1:4222"),
            (
                "nats+tls:/TOKEN1@127.0.0.1:4222",
                "nats+tls:/***@127.0.0.1:4222",
            ),
            ("nats:TOKEN1@h", "nats:***@h"),
            ("TOKEN1@h:4222", "***@h:4222"),
            ("nats://TOKEN1@h?x=1", "nats://***@h?x=1"),
            ("ftp://host/x", "ftp://host/x"),
            ("stdout", "stdout"),
        ] {
            assert_eq!(redact_unknown_url(url), shown, "{url}");
        }
    }

    #[test]
    fn kafka_oauth_and_jaas_settings_are_secrets() {
        let url = "kafka://b:9092?kafka.sasl.oauthbearer.config=principal%3Dx%20s3cr3t\
                   &kafka.sasl.jaas.config=pw&kafka.acks=all";
        let r = redact_url(url);
        assert!(!r.contains("s3cr3t") && !r.contains("=pw"), "{r}");
        assert!(r.contains("kafka.acks=all"), "{r}");
        let s = scrub("property value principal=x s3cr3t is invalid", url);
        assert!(!s.contains("s3cr3t"), "{s}");
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
