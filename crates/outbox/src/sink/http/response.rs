//! What an attempt's outcome means: a request's error, a response's status and its
//! `Retry-After` (the classification in the sink's module docs).

use crate::redact::redact_url;
use crate::sink::{PublishCode, PublishError};
use reqwest::StatusCode;
use std::time::Duration;

/// Longest `Retry-After` honoured; a longer one is cut to this (24 hours), so a
/// misbehaving endpoint cannot park a message for years.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// At most this many bytes of an error response's body are read (and counted, for its
/// length in the error message); the body itself never goes into the error, since an
/// endpoint may echo the payload back.
pub const ERROR_BODY_BYTES: usize = 64 * 1024;

/// A request's error: a connect error is the endpoint unreachable; a timeout otherwise
/// came after the request was sent.
pub(super) fn classify_error(e: reqwest::Error, describe: &str, timeout: Duration) -> PublishError {
    let text = error_chain(&e.without_url());
    // A connect error (refused, DNS, connect timeout, TLS handshake) means the request
    // never reached the endpoint.
    if text.connect {
        PublishError::unavailable(format!("cannot reach {describe}: {}", text.text))
            .with_code(PublishCode::NotConnected)
    } else if text.timeout {
        // The connection was made and the request sent; no response came within the
        // timeout: slow, not unreachable (the router judges what that costs).
        PublishError::timed_out_after_send(format!("{describe} did not answer within {timeout:?}"))
    } else {
        PublishError::transient(format!("POST to {describe} failed: {}", text.text))
    }
}

struct ErrorText {
    text: String,
    connect: bool,
    timeout: bool,
}

/// The error and its causes, deduplicated, as one line (no URL: `without_url` was applied).
fn error_chain(e: &reqwest::Error) -> ErrorText {
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let s = err.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
        cur = err.source();
    }
    ErrorText {
        text: parts.join(": "),
        connect: e.is_connect(),
        timeout: e.is_timeout(),
    }
}

/// How a status code is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StatusClass {
    Ok,
    Transient,
    /// The endpoint says it is overloaded or rate limiting (`429`, RFC 6585 §4; `503`,
    /// RFC 9110 §15.6.4): destination pressure, unavailable.
    Pressure,
    Permanent,
}

/// RFC 9110 §15 (and RFC 6585 §4 for 429).
fn classify_status(status: StatusCode) -> StatusClass {
    match status.as_u16() {
        200..=299 => StatusClass::Ok,
        429 | 503 => StatusClass::Pressure,
        // 504 Gateway Timeout (§15.6.5): a gateway got no answer in time; the request may
        // or may not have been processed. It is an answer (from the gateway), so not a
        // timeout of ours: transient.
        504 => StatusClass::Transient,
        408 | 409 | 500..=599 => StatusClass::Transient,
        _ => StatusClass::Permanent,
    }
}

pub(super) async fn classify_response(mut resp: reqwest::Response) -> Result<(), PublishError> {
    let status = resp.status();
    match classify_status(status) {
        StatusClass::Ok => {
            // Read (a bounded amount of) the body so the connection can be reused.
            let mut read = 0usize;
            while read <= 64 * 1024 {
                match resp.chunk().await {
                    Ok(Some(c)) => read += c.len(),
                    _ => break,
                }
            }
            Ok(())
        }
        class => {
            let header = |name| resp.headers().get(name).and_then(|v| v.to_str().ok());
            // An HTTP-date is the server's clock: measure it from the response's own Date.
            let server_now = header(reqwest::header::DATE)
                .and_then(parse_http_date)
                .unwrap_or_else(chrono::Utc::now);
            let retry_after =
                header(reqwest::header::RETRY_AFTER).and_then(|v| parse_retry_after(v, server_now));
            let body = body_length(&mut resp, ERROR_BODY_BYTES).await;
            let mut message = format!("HTTP {status}");
            if status.is_redirection() {
                if let Some(loc) = resp
                    .headers()
                    .get(reqwest::header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                {
                    message.push_str(&format!(
                        " (redirect to {:?} not followed: configure the final URL)",
                        redact_url(loc)
                    ));
                } else {
                    message.push_str(" (redirect not followed)");
                }
            }
            // The status only: the body may be the payload echoed back.
            match body {
                (0, _) => {}
                (n, false) => message.push_str(&format!(" (response body of {n} bytes not shown)")),
                (n, true) => {
                    message.push_str(&format!(" (response body over {n} bytes not shown)"));
                }
            }
            let code = if status.is_server_error() {
                PublishCode::Http5xx
            } else if status.is_client_error() {
                PublishCode::Http4xx
            } else {
                PublishCode::HttpOther
            };
            let mut e = match class {
                StatusClass::Pressure => PublishError::unavailable(message),
                StatusClass::Transient => PublishError::transient(message),
                _ => PublishError::permanent(message),
            }
            .with_code(code);
            e.retry_after = match class {
                StatusClass::Pressure | StatusClass::Transient => retry_after,
                _ => None,
            };
            Err(e)
        }
    }
}

/// How many bytes of the body there are, reading at most `limit` (so the connection can
/// be reused); `true` when there were more.
async fn body_length(resp: &mut reqwest::Response, limit: usize) -> (usize, bool) {
    let mut read = 0usize;
    while read <= limit {
        match resp.chunk().await {
            Ok(Some(c)) => read += c.len(),
            _ => return (read, false),
        }
    }
    (limit, true)
}

/// `Retry-After` (RFC 9110 §10.2.3): delta-seconds, or an HTTP-date (IMF-fixdate, and the
/// obsolete RFC 850 and asctime forms recipients must accept, §5.6.7) relative to `now`.
/// `now` is the server's clock: the response's `Date` header (§6.6.1), the relay's clock
/// only when the response has no parseable `Date`, so a server whose clock is off still
/// gets the delay it asked for. A date in the past gives zero; the result is capped at
/// [`MAX_RETRY_AFTER`]. `None` when the value is neither.
fn parse_retry_after(value: &str, now: chrono::DateTime<chrono::Utc>) -> Option<Duration> {
    let v = value.trim();
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        let secs = v.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER));
    }
    let date = parse_http_date(v)?;
    let delta = (date - now).to_std().unwrap_or(Duration::ZERO);
    Some(delta.min(MAX_RETRY_AFTER))
}

/// An HTTP-date (RFC 9110 §5.6.7): IMF-fixdate, RFC 850 or asctime.
fn parse_http_date(value: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    httpdate::parse_http_date(value.trim())
        .ok()
        .map(chrono::DateTime::<chrono::Utc>::from)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_accepts_seconds_and_every_http_date_form() {
        let now = chrono::DateTime::parse_from_rfc3339("1994-11-06T08:49:30Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        assert_eq!(parse_retry_after("2", now), Some(Duration::from_secs(2)));
        assert_eq!(
            parse_retry_after(" 120 ", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            parse_retry_after("Sunday, 06-Nov-94 08:49:37 GMT", now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            parse_retry_after("Sun Nov  6 08:49:37 1994", now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(
            parse_retry_after("99999999999999999999", now),
            Some(MAX_RETRY_AFTER)
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-1", now), None);
    }

    #[test]
    fn retry_after_dates_use_the_servers_clock() {
        // The relay's clock is a day ahead of the server's: with the server's Date as
        // "now", the requested 30 s stand.
        let server_date = "Sun, 06 Nov 1994 08:49:07 GMT";
        let retry_at = "Sun, 06 Nov 1994 08:49:37 GMT";
        let server_now = parse_http_date(server_date).unwrap();
        assert_eq!(
            parse_retry_after(retry_at, server_now),
            Some(Duration::from_secs(30))
        );
        let relay_now = server_now + chrono::Duration::days(1);
        assert_eq!(parse_retry_after(retry_at, relay_now), Some(Duration::ZERO));
        assert_eq!(parse_http_date("yesterday"), None);
    }

    #[test]
    fn status_classes() {
        let c = |s: u16| classify_status(StatusCode::from_u16(s).unwrap());
        assert_eq!(c(200), StatusClass::Ok);
        assert_eq!(c(204), StatusClass::Ok);
        for s in [408, 409, 500, 502, 504] {
            assert_eq!(c(s), StatusClass::Transient, "{s}");
        }
        for s in [429, 503] {
            assert_eq!(c(s), StatusClass::Pressure, "{s}");
        }
        for s in [301, 302, 400, 401, 403, 404, 410, 413, 422] {
            assert_eq!(c(s), StatusClass::Permanent, "{s}");
        }
    }
}
