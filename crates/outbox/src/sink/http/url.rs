//! The sink's own query parameters (`outbox_*`), taken out of the endpoint's URL before
//! any request is sent: the request timeout, the bearer token file and the envelope (the
//! TLS ones are read by [`crate::sink::tls`]).

use crate::cloudevents::{Binding, EnvelopeFormat};
use crate::sink::tls;
use reqwest::Url;
use std::time::Duration;

/// The query parameter that sets the request timeout, in milliseconds.
pub const TIMEOUT_PARAM: &str = "outbox_timeout_ms";

/// Removes [`TIMEOUT_PARAM`] from `url`'s query (the endpoint never sees it) and returns
/// its value; other parameters stay as written.
pub(super) fn take_timeout_param(url: &mut Url) -> Result<Option<Duration>, String> {
    let Some(query) = url.query() else {
        return Ok(None);
    };
    let mut timeout = None;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some((TIMEOUT_PARAM, v)) => {
                let ms = v.parse::<u64>().ok().filter(|ms| *ms > 0).ok_or_else(|| {
                    format!("{TIMEOUT_PARAM} must be a positive number of milliseconds, got {v:?}")
                })?;
                timeout = Some(Duration::from_millis(ms));
            }
            _ => kept.push(pair),
        }
    }
    if timeout.is_some() {
        let kept = kept.join("&");
        url.set_query((!kept.is_empty()).then_some(kept.as_str()));
    }
    Ok(timeout)
}

/// The prefix of the sink's own query parameters (removed before any request is sent):
/// `outbox_ca`, `outbox_cert`, `outbox_key` and `outbox_password_file` as in
/// [`crate::sink::tls`] (prefixed, because the endpoint's own query may use `key`),
/// [`BEARER_FILE_PARAM`] and [`ENVELOPE_PARAMS`].
pub const PARAM_PREFIX: &str = "outbox_";

/// `outbox_bearer_file=PATH`: every request carries `Authorization: Bearer <first line of
/// PATH>`. (Basic authentication comes from the URL's userinfo, or its password from
/// `outbox_password_file`.)
pub const BEARER_FILE_PARAM: &str = "outbox_bearer_file";

/// `outbox_envelope=cloudevents|cloudevents-binary|cloudevents-structured` and
/// `outbox_ce_source=URI-reference`: the CloudEvents envelope ([`crate::cloudevents`]).
pub const ENVELOPE_PARAMS: [&str; 2] = ["outbox_envelope", "outbox_ce_source"];

pub(super) fn take_envelope(url: &mut Url) -> Result<EnvelopeFormat, String> {
    let mut envelope = None;
    let mut source = None;
    for (name, value) in tls::take_params(url, &ENVELOPE_PARAMS) {
        if name == ENVELOPE_PARAMS[0] {
            envelope = Some(value);
        } else {
            source = Some(value);
        }
    }
    EnvelopeFormat::parse(
        Binding::Http,
        PARAM_PREFIX,
        envelope.as_deref(),
        source.as_deref(),
    )
}

pub(super) fn take_bearer(url: &mut Url) -> Result<Option<String>, tls::TlsError> {
    match tls::take_params(url, &[BEARER_FILE_PARAM]).pop() {
        None => Ok(None),
        Some((_, path)) => {
            tls::read_secret("outbox_bearer_file", std::path::Path::new(&path)).map(Some)
        }
    }
}
