//! Standard Webhooks signing and verification (feature `webhook`, which `http` enables; no
//! HTTP client is needed to verify).
//!
//! The scheme (<https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md>):
//! a delivery carries `webhook-id`, `webhook-timestamp` (Unix seconds) and
//! `webhook-signature` (space-separated `v1,<base64>` signatures, more than one while a
//! key is rotated); each signature is base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")).
//! The webhook sink signs with [`WebhookSecret::sign`]; a receiver checks with
//! [`WebhookSecret::verify`] (constant-time, with a timestamp [`TOLERANCE`] both ways)
//! before it trusts anything in the request, then reads the envelope with
//! [`crate::envelope::from_webhook`].

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::time::Duration;

/// Environment variable holding the signing secret (`whsec_<base64>`).
pub const SECRET_ENV: &str = "OUTBOX_WEBHOOK_SECRET";
/// Environment variable naming a file whose content is the signing secret (surrounding
/// whitespace ignored). Use it rather than [`SECRET_ENV`] where the environment is visible
/// to others (process listings, crash reports).
pub const SECRET_FILE_ENV: &str = "OUTBOX_WEBHOOK_SECRET_FILE";
/// Request header names that belong to HTTP, to a client or a proxy, or to the webhook
/// sink itself — never to a message: the sink refuses (permanently) a message header with
/// one of these names, and [`crate::envelope::from_webhook`] leaves them out.
pub const TRANSPORT_HEADERS: [&str; 24] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "expect",
    "proxy-connection",
    "idempotency-key",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "accept",
    "accept-encoding",
    "user-agent",
    "authorization",
    "via",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-real-ip",
];

/// How far a `webhook-timestamp` may be from the receiver's clock, either way: 5 minutes,
/// the tolerance of the Standard Webhooks reference libraries. An older delivery may be
/// a replay; a newer one comes from a sender whose clock is wrong.
pub const TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// A Standard Webhooks signing key: the decoded bytes of a `whsec_<base64>` secret. Its
/// `Debug` output never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(Vec<u8>);

impl fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WebhookSecret(<redacted>)")
    }
}

/// Why a signing secret could not be used. Never contains the secret.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookSecretError {
    /// The secret is not `whsec_` followed by standard base64 (or the base64 alone).
    #[error(
        "the webhook secret from {source_name} is not `whsec_<base64>` (standard base64 of the key bytes)"
    )]
    NotBase64 {
        /// Where it came from (an environment variable or file name).
        source_name: String,
    },
    /// The secret decodes to no bytes.
    #[error("the webhook secret from {source_name} is empty")]
    Empty {
        /// Where it came from.
        source_name: String,
    },
    /// Both [`SECRET_ENV`] and [`SECRET_FILE_ENV`] are set.
    #[error("both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one")]
    Ambiguous,
    /// The file named by [`SECRET_FILE_ENV`] cannot be read.
    #[error("cannot read the webhook secret file {path:?} (from {SECRET_FILE_ENV}): {source}")]
    File {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl WebhookSecret {
    /// Parses `whsec_<base64>` (the Standard Webhooks form; the bare base64 is accepted
    /// too, as the reference libraries do). Surrounding whitespace is ignored.
    ///
    /// # Errors
    /// [`WebhookSecretError::NotBase64`] or [`WebhookSecretError::Empty`]; `source_name`
    /// only names where the text came from in the message.
    pub fn parse(text: &str, source_name: &str) -> Result<Self, WebhookSecretError> {
        let t = text.trim();
        let b64 = t.strip_prefix("whsec_").unwrap_or(t);
        let key = BASE64
            .decode(b64)
            .map_err(|_| WebhookSecretError::NotBase64 {
                source_name: source_name.to_owned(),
            })?;
        if key.is_empty() {
            return Err(WebhookSecretError::Empty {
                source_name: source_name.to_owned(),
            });
        }
        Ok(WebhookSecret(key))
    }

    /// A key from its raw bytes.
    pub fn from_bytes(key: impl Into<Vec<u8>>) -> Self {
        WebhookSecret(key.into())
    }

    /// Reads the secret from [`SECRET_ENV`] or the file named by [`SECRET_FILE_ENV`];
    /// `None` when neither is set (requests are then unsigned).
    ///
    /// # Errors
    /// [`WebhookSecretError`] when both are set, the file cannot be read or the text is
    /// not a valid secret.
    pub fn from_env() -> Result<Option<Self>, WebhookSecretError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`WebhookSecret::from_env`] over any variable lookup (empty values count as unset).
    pub(crate) fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, WebhookSecretError> {
        let inline = get(SECRET_ENV).filter(|v| !v.is_empty());
        let file = get(SECRET_FILE_ENV).filter(|v| !v.is_empty());
        match (inline, file) {
            (Some(_), Some(_)) => Err(WebhookSecretError::Ambiguous),
            (Some(text), None) => Self::parse(&text, SECRET_ENV).map(Some),
            (None, Some(path)) => {
                let text =
                    std::fs::read_to_string(&path).map_err(|source| WebhookSecretError::File {
                        path: path.clone(),
                        source,
                    })?;
                Self::parse(&text, &path).map(Some)
            }
            (None, None) => Ok(None),
        }
    }

    /// The Standard Webhooks `webhook-signature` value for one delivery:
    /// `v1,` + base64(HMAC-SHA256(key, "{msg_id}.{timestamp}.{body}")).
    pub fn sign(&self, msg_id: &str, timestamp: i64, body: &[u8]) -> String {
        match self.mac(msg_id, &timestamp.to_string(), body) {
            Some(mac) => format!("v1,{}", BASE64.encode(mac.finalize().into_bytes())),
            None => String::new(),
        }
    }

    /// HMAC-SHA256 over `"{id}.{timestamp}.{body}"` under this key, the one content both
    /// [`WebhookSecret::sign`] and [`WebhookSecret::verify`] use. `None` only if `hmac`
    /// refused the key, which it does for no length.
    fn mac(&self, id: &str, timestamp: &str, body: &[u8]) -> Option<Hmac<Sha256>> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).ok()?;
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.as_bytes());
        mac.update(b".");
        mac.update(body);
        Some(mac)
    }
}

/// Why a delivery's signature was not accepted. Never contains the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// A `webhook-id`, `webhook-timestamp` or `webhook-signature` header is missing or not
    /// text.
    #[error("the {0} header is missing or not ASCII text: the delivery is not signed")]
    Missing(&'static str),
    /// `webhook-timestamp` is not a whole number of seconds.
    #[error("webhook-timestamp {0:?} is not Unix seconds")]
    BadTimestamp(String),
    /// The timestamp is further than [`TOLERANCE`] from the receiver's clock.
    #[error(
        "webhook-timestamp {timestamp} is {skew_s} s from this host's clock (tolerance {} s): a replay, or a clock that is wrong",
        TOLERANCE.as_secs()
    )]
    OutsideTolerance {
        /// The delivery's timestamp, Unix seconds.
        timestamp: i64,
        /// Its distance from the receiver's clock, seconds.
        skew_s: i64,
    },
    /// No `v1` signature in `webhook-signature` matches the body under this key.
    #[error("no webhook-signature matches the body under this key")]
    NoMatch,
}

impl WebhookSecret {
    /// Checks a delivery: `id`, `timestamp` and `signatures` are the raw values of the
    /// `webhook-id`, `webhook-timestamp` (decimal digits only) and `webhook-signature`
    /// headers, `body` the raw request body (before any JSON parsing), `now` the
    /// receiver's clock in Unix seconds. An empty key never verifies. Accepts when the timestamp is within [`TOLERANCE`] of `now` and any `v1`
    /// signature matches (compared in constant time by `hmac`'s `verify_slice`); other
    /// versions (`v1a,…`, asymmetric) are ignored.
    ///
    /// # Errors
    /// [`VerifyError::BadTimestamp`], [`VerifyError::OutsideTolerance`] or
    /// [`VerifyError::NoMatch`].
    pub fn verify(
        &self,
        id: &str,
        timestamp: &str,
        signatures: &str,
        body: &[u8],
        now: i64,
    ) -> Result<(), VerifyError> {
        let bad = || VerifyError::BadTimestamp(timestamp.chars().take(32).collect());
        if timestamp.is_empty() || !timestamp.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let ts: i64 = timestamp.parse().map_err(|_| bad())?;
        let skew = now.saturating_sub(ts);
        if skew.unsigned_abs() > TOLERANCE.as_secs() {
            return Err(VerifyError::OutsideTolerance {
                timestamp: ts,
                skew_s: skew,
            });
        }
        // An empty key is a key anyone can sign with.
        if self.0.is_empty() {
            return Err(VerifyError::NoMatch);
        }
        let Some(mac) = self.mac(id, timestamp, body) else {
            return Err(VerifyError::NoMatch);
        };
        for sig in signatures.split(' ') {
            let Some(b64) = sig.strip_prefix("v1,") else {
                continue;
            };
            let Ok(bytes) = BASE64.decode(b64) else {
                continue;
            };
            if mac.clone().verify_slice(&bytes).is_ok() {
                return Ok(());
            }
        }
        Err(VerifyError::NoMatch)
    }

    /// [`WebhookSecret::verify`] over a request's headers, against this host's clock.
    ///
    /// # Errors
    /// [`VerifyError::Missing`] when a signing header is absent, else as
    /// [`WebhookSecret::verify`].
    pub fn verify_headers(
        &self,
        headers: &http::HeaderMap,
        body: &[u8],
    ) -> Result<(), VerifyError> {
        let get = |name: &'static str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .ok_or(VerifyError::Missing(name))
        };
        self.verify(
            get("webhook-id")?,
            get("webhook-timestamp")?,
            get("webhook-signature")?,
            body,
            chrono::Utc::now().timestamp(),
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const KEY: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TS: i64 = 1_614_265_330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    // The reference libraries' test vector for KEY, ID, TS and BODY.
    const SIG: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    #[test]
    fn the_reference_vector_verifies_within_the_tolerance() {
        let key = WebhookSecret::parse(KEY, "test").unwrap();
        assert_eq!(key.verify(ID, "1614265330", SIG, BODY, TS), Ok(()));
        assert_eq!(key.verify(ID, "1614265330", SIG, BODY, TS + 300), Ok(()));
        assert_eq!(key.verify(ID, "1614265330", SIG, BODY, TS - 300), Ok(()));
        assert_eq!(
            key.verify(ID, "1614265330", SIG, BODY, TS + 301),
            Err(VerifyError::OutsideTolerance {
                timestamp: TS,
                skew_s: 301
            })
        );
        assert!(matches!(
            key.verify(ID, "1614265330", SIG, BODY, TS - 301),
            Err(VerifyError::OutsideTolerance { skew_s: -301, .. })
        ));
    }

    #[test]
    fn any_change_or_another_key_fails() {
        let key = WebhookSecret::parse(KEY, "test").unwrap();
        let other = WebhookSecret::from_bytes(b"another key".to_vec());
        let no = Err(VerifyError::NoMatch);
        assert_eq!(key.verify(ID, "1614265330", SIG, b"{\"test\": 1}", TS), no);
        assert_eq!(key.verify("msg_other", "1614265330", SIG, BODY, TS), no);
        assert_eq!(key.verify(ID, "1614265331", SIG, BODY, TS), no);
        assert_eq!(other.verify(ID, "1614265330", SIG, BODY, TS), no);
        assert_eq!(key.verify(ID, "1614265330", "v1,", BODY, TS), no);
        assert_eq!(key.verify(ID, "1614265330", "v2,abc", BODY, TS), no);
        for bad in [
            "soon",
            "",
            "+1614265330",
            " 1614265330",
            "-1",
            "1e9",
            "99999999999999999999",
        ] {
            assert!(
                matches!(
                    key.verify(ID, bad, SIG, BODY, TS),
                    Err(VerifyError::BadTimestamp(_))
                ),
                "{bad:?}"
            );
        }
        // A zero-padded timestamp is digits, but not what was signed.
        assert_eq!(key.verify(ID, "01614265330", SIG, BODY, TS), no);
        // An empty key is a key anyone can sign with.
        let empty = WebhookSecret::from_bytes(Vec::new());
        let forged = empty.sign(ID, TS, BODY);
        assert_eq!(empty.verify(ID, "1614265330", &forged, BODY, TS), no);
    }

    #[test]
    fn one_matching_signature_of_several_is_enough() {
        // During a key rotation the sender signs with both keys.
        let key = WebhookSecret::parse(KEY, "test").unwrap();
        let both = format!("v1,bm90IHRoaXMgb25l v1a,xyz {SIG}");
        assert_eq!(key.verify(ID, "1614265330", &both, BODY, TS), Ok(()));
    }

    #[test]
    fn headers_are_read_and_their_absence_named() {
        let key = WebhookSecret::parse(KEY, "test").unwrap();
        let now = chrono::Utc::now().timestamp();
        let sig = key.sign(ID, now, BODY);
        let mut h = http::HeaderMap::new();
        h.insert("webhook-id", http::HeaderValue::from_static(ID));
        h.insert("webhook-timestamp", http::HeaderValue::from(now));
        assert_eq!(
            key.verify_headers(&h, BODY),
            Err(VerifyError::Missing("webhook-signature"))
        );
        h.insert(
            "webhook-signature",
            http::HeaderValue::from_str(&sig).unwrap(),
        );
        assert_eq!(key.verify_headers(&h, BODY), Ok(()));
        assert_eq!(
            key.verify_headers(&h, b"tampered"),
            Err(VerifyError::NoMatch)
        );
    }
}
