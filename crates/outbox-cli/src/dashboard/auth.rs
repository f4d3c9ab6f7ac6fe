//! Who may use the admin server: bearer tokens with a name and a role, from
//! `OUTBOX_ADMIN_TOKEN` (operator), `OUTBOX_ADMIN_READ_TOKEN` (read-only) and a tokens file
//! (`name:role:token` lines). The token travels in the `Authorization` header, never in a
//! cookie, so a page of another site cannot make the browser send it (the CSRF defence);
//! a request whose `Origin` names another host is refused besides.

use anyhow::Context as _;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// The shortest token accepted: 16 characters (a guessable token is no lock).
pub(crate) const MIN_TOKEN_LEN: usize = 16;

/// The admin server's credentials, as flags (or their environment variables).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct AuthArgs {
    /// Bearer token of an operator (may replay, discard, pause, see payloads), named
    /// `admin` in the audit rows. At least 16 characters. Prefer the environment
    /// variable or the tokens file: a flag's value shows in the process list.
    #[arg(long, env = "OUTBOX_ADMIN_TOKEN", hide_env_values = true)]
    pub(crate) admin_token: Option<String>,
    /// Bearer token that may only read (no payloads, no changes), named `reader`. As
    /// --admin-token, prefer the environment variable.
    #[arg(long, env = "OUTBOX_ADMIN_READ_TOKEN", hide_env_values = true)]
    pub(crate) admin_read_token: Option<String>,
    /// A file of tokens, one per line: `name:role:token`, role `operator` or `read`
    /// (`#` starts a comment). The name is what the audit rows record as who.
    #[arg(long, env = "OUTBOX_ADMIN_TOKENS_FILE")]
    pub(crate) admin_tokens_file: Option<PathBuf>,
}

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Role {
    /// Read everything but payloads.
    Read,
    /// Read payloads too, replay, discard, pause and resume.
    Operator,
}

/// The caller of one request (a request extension set by [`authenticate`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Caller {
    /// The token's name: what audit rows record as who.
    pub(crate) name: String,
    /// What it may do.
    pub(crate) role: Role,
}

#[derive(Debug, Clone)]
struct Token {
    caller: Caller,
    secret: Vec<u8>,
}

/// The configured tokens; none means an open server (loopback only).
#[derive(Debug, Clone, Default)]
pub(crate) struct Tokens(Vec<Token>);

impl Tokens {
    /// The tokens of `args`: the two variables and the file.
    ///
    /// # Errors
    /// A token shorter than [`MIN_TOKEN_LEN`], of spaces only or of one character
    /// repeated, an unreadable file, a malformed line, a token given twice.
    pub(crate) fn load(args: &AuthArgs) -> anyhow::Result<Self> {
        let mut tokens = Vec::new();
        let mut add = |name: &str, role: Role, secret: &str, origin: &str| {
            anyhow::ensure!(
                secret.chars().count() >= MIN_TOKEN_LEN,
                "{origin}: the token is shorter than {MIN_TOKEN_LEN} characters"
            );
            anyhow::ensure!(
                !secret.trim().is_empty(),
                "{origin}: the token is only spaces: use a random one (e.g. openssl rand -hex 24)"
            );
            anyhow::ensure!(
                secret.chars().any(|c| !secret.starts_with(c)),
                "{origin}: the token is one character repeated, which anyone can guess: use a random one (e.g. openssl rand -hex 24)"
            );
            anyhow::ensure!(
                !tokens.iter().any(|t: &Token| t.secret == secret.as_bytes()),
                "{origin}: this token is given twice"
            );
            anyhow::ensure!(
                !tokens.iter().any(|t: &Token| t.caller.name == name),
                "{origin}: the name {name:?} is given twice (the audit could not tell them apart)"
            );
            tokens.push(Token {
                caller: Caller {
                    name: name.to_owned(),
                    role,
                },
                secret: secret.as_bytes().to_vec(),
            });
            Ok(())
        };
        if let Some(t) = args.admin_token.as_deref().filter(|t| !t.is_empty()) {
            add("admin", Role::Operator, t, "OUTBOX_ADMIN_TOKEN")?;
        }
        if let Some(t) = args.admin_read_token.as_deref().filter(|t| !t.is_empty()) {
            add("reader", Role::Read, t, "OUTBOX_ADMIN_READ_TOKEN")?;
        }
        if let Some(file) = &args.admin_tokens_file {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("cannot read the tokens file {}", file.display()))?;
            let mut in_file = 0;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let origin = format!("{} line {}", file.display(), n + 1);
                let mut parts = line.splitn(3, ':');
                let (Some(name), Some(role), Some(secret)) =
                    (parts.next(), parts.next(), parts.next())
                else {
                    anyhow::bail!(
                        "{origin}: expected name:role:token (three fields separated by ':'; values not shown)"
                    );
                };
                let name = name.trim();
                anyhow::ensure!(
                    !name.is_empty()
                        && name.chars().all(|c| {
                            c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '@')
                        }),
                    "{origin}: the name (first field) must be letters, digits, '.', '_', '-' or '@' (expected name:role:token)"
                );
                let role = match role.trim() {
                    "operator" => Role::Operator,
                    "read" => Role::Read,
                    // Not quoted: with the fields in the wrong order it may be the token.
                    _ => anyhow::bail!(
                        "{origin}: the role (second field) is neither \"operator\" nor \"read\" (expected name:role:token; values not shown)"
                    ),
                };
                add(name, role, secret.trim(), &origin)?;
                in_file += 1;
            }
            // A tokens file that names no token would leave the server open.
            anyhow::ensure!(
                in_file > 0,
                "the tokens file {} holds no token (lines name:role:token): refusing to serve the admin API without one",
                file.display()
            );
        }
        Ok(Tokens(tokens))
    }

    /// True when no token is configured.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The caller a presented token names; every configured token is compared in full
    /// (no early exit on the first differing byte).
    fn find(&self, presented: &[u8]) -> Option<&Caller> {
        let mut found = None;
        for t in &self.0 {
            if constant_time_eq(&t.secret, presented) {
                found = Some(&t.caller);
            }
        }
        found
    }
}

/// Compares two byte strings in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Refuses an open server (no token) on an address other than loopback, saying why.
///
/// # Errors
/// No token and a non-loopback address.
pub(crate) fn check_exposure(flag: &str, addr: SocketAddr, tokens: &Tokens) -> anyhow::Result<()> {
    if tokens.is_empty() && !addr.ip().is_loopback() {
        anyhow::bail!(
            "{flag} {addr}: refusing to serve the admin API on an address other than loopback without a token: anyone who reaches it could replay, discard and pause. Set OUTBOX_ADMIN_TOKEN (operator) and/or OUTBOX_ADMIN_READ_TOKEN, or --admin-tokens-file FILE (lines name:role:token), or listen on 127.0.0.1"
        );
    }
    if tokens.is_empty() {
        tracing::warn!(
            addr = %addr,
            "no admin token configured: every local user of this host may use the admin API as operator \"local\" (loopback only; set OUTBOX_ADMIN_TOKEN to require one)"
        );
    }
    Ok(())
}

/// A JSON error response.
pub(crate) fn error(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
}

/// Paths anyone may read: the page (it holds no data and asks for the token) and the
/// probes.
fn is_public(path: &str) -> bool {
    matches!(path, "/" | "/healthz" | "/readyz")
}

/// The host of an `Origin` value (`http://host:port` → `host:port`).
fn origin_host(origin: &str) -> Option<&str> {
    let rest = origin.split_once("://")?.1;
    Some(rest.split('/').next().unwrap_or(rest))
}

/// True when the request's `Origin` (if any) names the host it was sent to.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return true;
    };
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    match (origin.to_str().ok().and_then(origin_host), host) {
        (Some(o), Some(h)) => o.eq_ignore_ascii_case(h),
        _ => false,
    }
}

/// True when the request's `Host` is an IP address or `localhost` (any port): the only
/// names an open server (no token, loopback) answers to, so a page of another site whose
/// name was rebound to 127.0.0.1 (DNS rebinding) cannot use it.
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(n, _)| n)
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok()
}

/// The middleware: the origin check, then the token (401 without a valid one), then the
/// role (403 for a read-only token on a change); the caller goes into the request's
/// extensions.
pub(crate) async fn authenticate(
    State(tokens): State<Arc<Tokens>>,
    mut req: Request,
    next: Next,
) -> Response {
    if !same_origin(req.headers()) {
        return error(
            StatusCode::FORBIDDEN,
            "cross-origin request refused: the Origin header names another host",
        );
    }
    if tokens.is_empty() && !loopback_host(req.headers()) {
        return error(
            StatusCode::FORBIDDEN,
            "without an admin token this server answers only to an IP address or localhost in the Host header",
        );
    }
    if is_public(req.uri().path()) {
        return next.run(req).await;
    }
    let caller = if tokens.is_empty() {
        Caller {
            name: "local".into(),
            role: Role::Operator,
        }
    } else {
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                // The scheme is case-insensitive (RFC 7235, 2.1).
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(token)
            })
            .map(str::trim);
        match presented.and_then(|p| tokens.find(p.as_bytes())) {
            Some(c) => c.clone(),
            None => {
                let mut r = error(
                    StatusCode::UNAUTHORIZED,
                    if presented.is_none() {
                        "an Authorization: Bearer TOKEN header is required"
                    } else {
                        "the token is not valid"
                    },
                );
                r.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    axum::http::HeaderValue::from_static("Bearer"),
                );
                return r;
            }
        }
    };
    if req.method() != Method::GET && req.method() != Method::HEAD && caller.role != Role::Operator
    {
        return error(
            StatusCode::FORBIDDEN,
            &format!(
                "token {:?} is read-only: replay, discard, pause and resume need an operator token",
                caller.name
            ),
        );
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_open_server_answers_only_to_ip_or_localhost_hosts() {
        let with = |host: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::HOST, host.parse().unwrap());
            loopback_host(&h)
        };
        for ok in [
            "127.0.0.1:8080",
            "localhost:8080",
            "LOCALHOST",
            "[::1]:8080",
            "127.0.0.1",
        ] {
            assert!(with(ok), "{ok}");
        }
        for bad in [
            "attacker.example:8080",
            "attacker.example",
            "127.0.0.1.nip.io:80",
        ] {
            assert!(!with(bad), "{bad}");
        }
        assert!(!loopback_host(&HeaderMap::new()), "no Host");
    }

    #[test]
    fn tokens_file_lines_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens");
        std::fs::write(
            &file,
            "# who:role:token\ndana:operator:0123456789abcdef0123\n\nbot:read:f0e1d2c3b4a5968778f9\n",
        )
        .unwrap();
        let args = AuthArgs {
            admin_tokens_file: Some(file.clone()),
            ..AuthArgs::default()
        };
        let t = Tokens::load(&args).unwrap();
        assert_eq!(
            t.find(b"0123456789abcdef0123")
                .map(|c| (c.name.as_str(), c.role)),
            Some(("dana", Role::Operator))
        );
        assert_eq!(
            t.find(b"f0e1d2c3b4a5968778f9").map(|c| c.role),
            Some(Role::Read)
        );
        assert!(t.find(b"0123456789abcdef012").is_none());
        std::fs::write(&file, "dana:boss:0123456789abcdef0123\n").unwrap();
        let e = Tokens::load(&args).map(|_| ()).unwrap_err().to_string();
        // The line and the field, never the value (it may be a token in the wrong place).
        assert!(e.contains("line 1: the role (second field)"), "{e}");
        assert!(!e.contains("boss"), "{e}");
        std::fs::write(&file, "# tokens come later\n").unwrap();
        let e = Tokens::load(&args).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("holds no token"), "{e}");
        std::fs::write(
            &file,
            "dana:operator:0123456789abcdef0123\ndana:read:f0e1d2c3b4a5968778f9\n",
        )
        .unwrap();
        let e = Tokens::load(&args).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("given twice"), "{e}");
        let short = AuthArgs {
            admin_token: Some("short".into()),
            ..AuthArgs::default()
        };
        assert!(Tokens::load(&short).is_err());
        let addr: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        assert!(check_exposure("--listen", addr, &Tokens::default()).is_err());
        let local: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        assert!(check_exposure("--listen", local, &Tokens::default()).is_ok());
    }

    #[test]
    fn origin_must_name_the_host() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "127.0.0.1:8080".parse().unwrap());
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, "http://127.0.0.1:8080".parse().unwrap());
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, "http://evil.example".parse().unwrap());
        assert!(!same_origin(&h));
    }
}
