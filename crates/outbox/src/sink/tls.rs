//! TLS and secrets shared by the network sinks' URLs.
//!
//! Every TLS-capable sink URL takes the same query parameters, removed from the URL before
//! the broker's client sees it:
//!
//! | parameter | meaning |
//! | --- | --- |
//! | `ca=PATH` | a PEM bundle of certificate authorities to trust **besides** the system roots (default: the file named by `OUTBOX_TLS_CA_FILE`, when set) |
//! | `cert=PATH&key=PATH` | the client's identity (mutual TLS): a PEM certificate chain and its PEM private key (PKCS#8, PKCS#1 or SEC1); one without the other is an error |
//! | `password_file=PATH` | the userinfo's password, read from a file (the first line; for secrets mounted by a container platform) instead of the URL |
//!
//! One crypto provider serves the whole workspace (rustls with *ring*; a second provider
//! compiled in makes rustls panic at first use), installed by [`install_provider`].
//!
//! Certificate problems are errors when the sink is opened, never a retry loop:
//! [`TlsFiles::client_config`] names the file it could not read or parse, and
//! [`check_handshake`] makes one TLS handshake with the server at start and names the host
//! and what rustls found wrong (an unknown issuer, a name mismatch, an expired
//! certificate). A server that cannot be reached at start is not an error (the sink keeps
//! connecting in the background and reports the destination unavailable meanwhile).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The environment variable naming the CA bundle every sink trusts when its URL has no
/// `ca=`.
pub const CA_FILE_ENV: &str = "OUTBOX_TLS_CA_FILE";

/// How long [`check_handshake`] waits for the TCP connection and then for the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// What went wrong with a TLS setting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file named by `ca`, `cert`, `key` or `password_file` could not be read.
    #[error("cannot read {what} file {path:?}: {source}")]
    Read {
        /// Which setting named it (`ca`, `cert`, `key`, `password_file`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no PEM certificate, or a malformed one, or no usable private key.
    #[error("{what} file {path:?}: {reason}")]
    Parse {
        /// Which setting named it.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// `cert` without `key` or the other way round.
    #[error("cert= and key= go together: give both or neither")]
    HalfIdentity,
    /// rustls refused the configuration (for example a key that does not match the
    /// certificate).
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// The handshake with the server failed (certificate not trusted, wrong host name,
    /// expired, the server refused ours, or the port does not speak TLS).
    #[error(
        "TLS handshake with {host}:{port} failed: {reason} (trusting the system roots{})",
        ca.as_ref().map(|p| format!(" and {}", p.display())).unwrap_or_default()
    )]
    Handshake {
        /// The server's host name as given.
        host: String,
        /// Its port.
        port: u16,
        /// What rustls (or the connection) said.
        reason: String,
        /// The CA bundle trusted besides the system roots.
        ca: Option<PathBuf>,
    },
}

/// A client identity as PEM text: the certificate chain, then the private key.
pub type IdentityPem = (Vec<u8>, Vec<u8>);

/// The TLS files a sink URL names (`ca`, `cert`, `key`); see the module docs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA bundle (PEM) trusted besides the system roots.
    pub ca: Option<PathBuf>,
    /// Client certificate chain (PEM).
    pub cert: Option<PathBuf>,
    /// Client private key (PEM).
    pub key: Option<PathBuf>,
    /// `ca` came from `OUTBOX_TLS_CA_FILE`, not from the URL.
    pub(crate) default_ca: bool,
}

impl TlsFiles {
    /// True when the URL itself named a TLS file (`ca`, `cert` or `key`); a CA from
    /// `OUTBOX_TLS_CA_FILE` does not count.
    pub fn named(&self) -> bool {
        self.ca.is_some() && !self.default_ca || self.cert.is_some() || self.key.is_some()
    }

    /// The CA bundle's certificates, checked: at least one, each parseable.
    ///
    /// # Errors
    /// [`TlsError::Read`] or [`TlsError::Parse`] naming the file.
    pub fn ca_certificates(&self) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        match &self.ca {
            None => Ok(Vec::new()),
            Some(path) => read_certificates("ca", path),
        }
    }

    /// The CA bundle as PEM text (for clients that take PEM), checked like
    /// [`TlsFiles::ca_certificates`].
    ///
    /// # Errors
    /// As [`TlsFiles::ca_certificates`].
    pub fn ca_pem(&self) -> Result<Option<Vec<u8>>, TlsError> {
        match &self.ca {
            None => Ok(None),
            Some(path) => {
                read_certificates("ca", path)?;
                Ok(Some(read("ca", path)?))
            }
        }
    }

    /// The client identity as PEM (certificate chain, private key), checked.
    ///
    /// # Errors
    /// [`TlsError::HalfIdentity`] for one without the other; [`TlsError::Read`] or
    /// [`TlsError::Parse`] naming the file.
    pub fn identity_pem(&self) -> Result<Option<IdentityPem>, TlsError> {
        match (&self.cert, &self.key) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => {
                read_certificates("cert", cert)?;
                read_key(key)?;
                Ok(Some((read("cert", cert)?, read("key", key)?)))
            }
            _ => Err(TlsError::HalfIdentity),
        }
    }

    /// A rustls client configuration: the system's roots plus the CA bundle, and the
    /// client identity when given; on the workspace's one provider (*ring*).
    ///
    /// # Errors
    /// As [`TlsFiles::ca_certificates`] and [`TlsFiles::identity_pem`]; [`TlsError::Config`]
    /// when rustls refuses the key.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        // The system's roots: what fails to load or parse is skipped (a CA bundle may still
        // make the configuration useful).
        let native = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(native.certs);
        for cert in self.ca_certificates()? {
            roots.add(cert).map_err(|e| TlsError::Parse {
                what: "ca",
                path: self.ca.clone().unwrap_or_default(),
                reason: e.to_string(),
            })?;
        }
        let builder =
            rustls::ClientConfig::builder_with_provider(Arc::new(crate::crypto::ring_provider()))
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots);
        Ok(match (&self.cert, &self.key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                builder.with_client_auth_cert(read_certificates("cert", cert)?, read_key(key)?)?
            }
            _ => return Err(TlsError::HalfIdentity),
        })
    }
}

/// Removes `ca`, `cert`, `key` and `password_file` from `url`'s query and applies them:
/// the password file's first line becomes the URL's password; the TLS files come back
/// (with the `OUTBOX_TLS_CA_FILE` default when no `ca` was given). Other parameters stay in
/// place, in order; an emptied query is removed.
///
/// # Errors
/// [`TlsError::Read`] when the password file cannot be read, [`TlsError::Parse`] when the
/// URL cannot carry a password (no host).
pub fn take_settings(url: &mut url::Url) -> Result<TlsFiles, TlsError> {
    take_prefixed(url, "")
}

/// As [`take_settings`], for parameter names that start with `prefix` (the webhook sink's
/// `outbox_ca`, `outbox_cert`, … : a webhook endpoint's own query may use `key`).
///
/// # Errors
/// As [`take_settings`].
pub fn take_prefixed(url: &mut url::Url, prefix: &str) -> Result<TlsFiles, TlsError> {
    let mut files = TlsFiles::default();
    let mut password_file = None;
    let names = ["ca", "cert", "key", "password_file"].map(|n| format!("{prefix}{n}"));
    for (name, value) in take_params(url, &names.each_ref().map(String::as_str)) {
        let path = Some(PathBuf::from(value));
        match name.strip_prefix(prefix) {
            Some("ca") => files.ca = path,
            Some("cert") => files.cert = path,
            Some("key") => files.key = path,
            _ => password_file = path,
        }
    }
    if files.ca.is_none()
        && let Some(ca) = default_ca()
    {
        files.ca = Some(ca);
        files.default_ca = true;
    }
    if let Some(path) = password_file {
        let password = read_secret("password_file", &path)?;
        set_password(url, &password).map_err(|()| TlsError::Parse {
            what: "password_file",
            path: path.clone(),
            reason: "this URL cannot carry a password".into(),
        })?;
    }
    Ok(files)
}

/// Sets `url`'s password to `password` taken literally: every character that cannot stand
/// in a URL's userinfo is percent-encoded, `%` included (the `url` crate leaves a `%` as it
/// is, and the clients percent-decode the password, so `a%41` would arrive as `aA`).
///
/// # Errors
/// `Err(())` when the URL cannot carry a password (no host).
#[allow(clippy::result_unit_err)]
pub fn set_password(url: &mut url::Url, password: &str) -> Result<(), ()> {
    url.set_password(Some(&password.replace('%', "%25")))
}

static DEFAULT_CA: std::sync::RwLock<Option<PathBuf>> = std::sync::RwLock::new(None);

/// Sets the CA bundle every sink URL without `ca=` trusts besides the system roots, for
/// this process (the `outbox` binary's `--tls-ca-file`); it takes precedence over
/// `OUTBOX_TLS_CA_FILE`. `None` goes back to the environment variable.
pub fn set_default_ca(path: Option<PathBuf>) {
    if let Ok(mut slot) = DEFAULT_CA.write() {
        *slot = path;
    }
}

/// The CA bundle a URL without `ca=` gets: [`set_default_ca`], else `OUTBOX_TLS_CA_FILE`.
pub fn default_ca() -> Option<PathBuf> {
    DEFAULT_CA
        .read()
        .ok()
        .and_then(|slot| slot.clone())
        .or_else(|| {
            std::env::var_os(CA_FILE_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
}

/// Removes the query parameters called one of `names` from `url` and returns them
/// (decoded), in order. The other parameters stay exactly as written (not re-encoded: a
/// webhook endpoint's query belongs to its owner); an emptied query is removed.
pub fn take_params(url: &mut url::Url, names: &[&str]) -> Vec<(String, String)> {
    let Some(query) = url.query() else {
        return Vec::new();
    };
    let mut taken = Vec::new();
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match url::form_urlencoded::parse(pair.as_bytes()).next() {
            Some((k, v)) if names.contains(&k.as_ref()) => {
                taken.push((k.into_owned(), v.into_owned()));
            }
            _ => kept.push(pair),
        }
    }
    if !taken.is_empty() {
        let kept = kept.join("&");
        url.set_query((!kept.is_empty()).then_some(kept.as_str()));
    }
    taken
}

/// The first line of a secret file (a trailing newline, and `\r`, removed), as container
/// platforms mount secrets.
///
/// # Errors
/// [`TlsError::Read`] when the file cannot be read; [`TlsError::Parse`] when it is empty or
/// not UTF-8.
pub fn read_secret(what: &'static str, path: &Path) -> Result<String, TlsError> {
    let bytes = read(what, path)?;
    let text = String::from_utf8(bytes).map_err(|_| TlsError::Parse {
        what,
        path: path.to_owned(),
        reason: "not UTF-8 text".into(),
    })?;
    let line = text.lines().next().unwrap_or("").trim_end_matches('\r');
    if line.is_empty() {
        return Err(TlsError::Parse {
            what,
            path: path.to_owned(),
            reason: "the file is empty".into(),
        });
    }
    Ok(line.to_owned())
}

/// Installs the workspace's one rustls provider (*ring*) as the process default, for
/// clients that take it from there. A provider already installed (by another sink or by
/// the host application) is kept.
pub fn install_provider() {
    let _ = crate::crypto::ring_provider().install_default();
}

/// What [`check_handshake`] does before TLS starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preamble {
    /// TLS from the first byte (HTTPS, AMQPS, MQTTS, `rediss://`).
    None,
    /// NATS: the server sends its `INFO` line in plain text first, then TLS starts; when
    /// TLS is not `required` by the client, only if the server's `INFO` requires it.
    NatsInfo {
        /// The client requires TLS (`tls://`, a client certificate).
        required: bool,
    },
}

/// One TLS handshake with `host:port` using `config`, to turn a certificate problem into a
/// clear error at start. A server that cannot be reached (refused, unreachable, no answer
/// within [`HANDSHAKE_TIMEOUT`], or a connection closed before the server sent anything, as
/// a proxy whose backend is down does) is `Ok`, with a warning: that is an outage, for the
/// sink's own reconnects.
///
/// # Errors
/// [`TlsError::Handshake`] naming the host and what went wrong.
pub async fn check_handshake(
    host: &str,
    port: u16,
    config: Arc<rustls::ClientConfig>,
    preamble: Preamble,
    ca: Option<&Path>,
) -> Result<(), TlsError> {
    use tokio::io::AsyncBufReadExt;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let fail = |reason: String| TlsError::Handshake {
        host: host.to_owned(),
        port,
        reason,
        ca: ca.map(Path::to_owned),
    };
    let Ok(Ok(tcp)) = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        tokio::net::TcpStream::connect((bare, port)),
    )
    .await
    else {
        return Ok(());
    };
    let outage = |reason: &str| {
        tracing::warn!(
            host,
            port,
            "{reason}: taken as an outage, the sink keeps connecting"
        );
        Ok(())
    };
    let mut tcp = tokio::io::BufReader::new(tcp);
    if let Preamble::NatsInfo { required } = preamble {
        let mut line = String::new();
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, tcp.read_line(&mut line)).await {
            Ok(Ok(n)) if n > 0 && line.starts_with("INFO ") => {
                let server_requires = serde_json::from_str::<serde_json::Value>(&line[5..])
                    .ok()
                    .and_then(|info| info.get("tls_required").and_then(|v| v.as_bool()))
                    .unwrap_or(false);
                if !required && !server_requires {
                    return Ok(());
                }
            }
            Ok(Ok(0)) | Ok(Err(_)) => {
                return outage("the server closed the connection before its INFO");
            }
            Ok(Ok(_)) => return Err(fail("the server did not greet as NATS does".into())),
            Err(_) => return outage("no INFO from the server"),
        }
    }
    let name = ServerName::try_from(bare.to_owned())
        .map_err(|e| fail(format!("{bare:?} is not a host name for TLS: {e}")))?;
    let connector = tokio_rustls::TlsConnector::from(config);
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(name, tcp)).await {
        Ok(Ok(_)) => Ok(()),
        // Nothing came back: a server that is not there yet, not a wrong certificate.
        Ok(Err(e))
            if e.get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                .is_none()
                && matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::BrokenPipe
                ) =>
        {
            outage("the server closed the connection during the TLS handshake (is the port TLS?)")
        }
        Ok(Err(e)) => Err(fail(describe_io(&e))),
        Err(_) => outage("no answer to the TLS handshake (is the port TLS?)"),
    }
}

/// True when `host:port` answers a TLS ClientHello as a TLS server does (whether or not its
/// certificate would be trusted): for telling an operator who gave a plain-text URL for a
/// TLS-only port which URL to use. False when it cannot be reached or does not speak TLS.
pub async fn speaks_tls(host: &str, port: u16) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let Ok(Ok(tcp)) = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        tokio::net::TcpStream::connect((bare, port)),
    )
    .await
    else {
        return false;
    };
    let Ok(config) = TlsFiles::default().client_config() else {
        return false;
    };
    let Ok(name) = ServerName::try_from(bare.to_owned()) else {
        return false;
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(name, tcp)).await {
        Ok(Ok(_)) => true,
        // A certificate was presented: the port speaks TLS.
        Ok(Err(e)) => matches!(
            e.get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>()),
            Some(rustls::Error::InvalidCertificate(_) | rustls::Error::AlertReceived(_))
        ),
        Err(_) => false,
    }
}

/// rustls's error behind an I/O error, in words.
fn describe_io(e: &std::io::Error) -> String {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidCertificate(c)) => format!("invalid peer certificate: {c:?}"),
        Some(rustls::Error::InvalidMessage(_)) => {
            "the server does not speak TLS on this port".into()
        }
        Some(other) => other.to_string(),
        None if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            "the server closed the connection during the handshake (is the port TLS?)".into()
        }
        None => e.to_string(),
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

fn read_certificates(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Parse {
            what,
            path: path.to_owned(),
            reason: format!("not a PEM certificate bundle: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Parse {
            what,
            path: path.to_owned(),
            reason: "no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into(),
        });
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read("key", path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Parse {
        what: "key",
        path: path.to_owned(),
        reason: format!("no PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_taken_out_of_the_query_and_the_rest_kept() {
        let mut u = url::Url::parse("nats://h:4222/?ca=/a.pem&x=1&cert=/c.pem&key=/k.pem&y=2")
            .unwrap_or_else(|e| panic!("{e}"));
        let files = take_settings(&mut u).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(files.ca.as_deref(), Some(Path::new("/a.pem")));
        assert_eq!(files.cert.as_deref(), Some(Path::new("/c.pem")));
        assert_eq!(files.key.as_deref(), Some(Path::new("/k.pem")));
        assert_eq!(u.query(), Some("x=1&y=2"));
        let mut u = url::Url::parse("amqps://h/?ca=/a.pem").unwrap_or_else(|e| panic!("{e}"));
        take_settings(&mut u).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(u.as_str(), "amqps://h/");
    }

    #[test]
    fn a_password_file_fills_the_password() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("pw");
        std::fs::write(&path, "s3cr:et@/\n").unwrap_or_else(|e| panic!("{e}"));
        let mut u = url::Url::parse(&format!(
            "redis://app@h:6379/?password_file={}",
            path.display()
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        take_settings(&mut u).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(u.username(), "app");
        let decoded = percent_encoding::percent_decode_str(u.password().unwrap_or(""))
            .decode_utf8_lossy()
            .into_owned();
        assert_eq!(decoded, "s3cr:et@/");
        assert_eq!(u.query(), None);
        // An empty or missing file is a clear error naming it.
        std::fs::write(&path, "\n").unwrap_or_else(|e| panic!("{e}"));
        let mut u = url::Url::parse(&format!("redis://h/?password_file={}", path.display()))
            .unwrap_or_else(|e| panic!("{e}"));
        let e = take_settings(&mut u)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("empty") && e.contains("pw"), "{e}");
    }

    #[test]
    fn a_password_file_is_taken_literally() {
        // A `%` in the file is part of the password, not the start of an escape: the
        // clients percent-decode the URL's password.
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("pw");
        for password in ["a%41b", "100%", "%2F%zz%"] {
            std::fs::write(&path, format!("{password}\n")).unwrap_or_else(|e| panic!("{e}"));
            let mut u = url::Url::parse(&format!("amqp://app@h/?password_file={}", path.display()))
                .unwrap_or_else(|e| panic!("{e}"));
            take_settings(&mut u).unwrap_or_else(|e| panic!("{e}"));
            let decoded = percent_encoding::percent_decode_str(u.password().unwrap_or(""))
                .decode_utf8_lossy()
                .into_owned();
            assert_eq!(decoded, password, "{u}");
        }
    }

    #[test]
    fn bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "hello").unwrap_or_else(|e| panic!("{e}"));
        let files = TlsFiles {
            ca: Some(junk.clone()),
            ..TlsFiles::default()
        };
        let e = files
            .client_config()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("junk.pem") && e.contains("no PEM certificate"),
            "{e}"
        );
        let files = TlsFiles {
            ca: Some(dir.path().join("missing.pem")),
            ..TlsFiles::default()
        };
        let e = files
            .client_config()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("missing.pem") && e.contains("cannot read ca"),
            "{e}"
        );
        let files = TlsFiles {
            cert: Some(junk),
            ..TlsFiles::default()
        };
        assert!(matches!(files.client_config(), Err(TlsError::HalfIdentity)));
    }
}
