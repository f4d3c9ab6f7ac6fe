//! What the Redis sinks share: the URL's connection part (TLS files, password file,
//! `protocol`), the client built from it, one multiplexed connection made lazily and
//! re-made after a failure, the checks made at start (credentials, a TLS port named with a
//! plain scheme) and what a failed command means.
//!
//! [`super::redis_streams`] (`redis://`) and [`super::sidekiq`] (`sidekiq://`) each read
//! their own parameters and build their commands; everything about reaching the server is
//! here.

use super::{PublishCode, PublishError, SinkError};
use crate::redact::redact_url as redact;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisError, RedisResult};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// A Redis URL taken apart: the URL the client gets (`redis://` or `rediss://`, our
/// parameters removed, the password of `password_file` put in), the TLS files, and the
/// query parameters the sink itself reads.
pub(crate) struct RedisUrl {
    /// For the client: `redis://…` or `rediss://…`, with `protocol` kept.
    pub(crate) client_url: String,
    pub(crate) files: super::tls::TlsFiles,
    /// The parameters other than TLS, `password_file` and `protocol`, in order.
    pub(crate) params: Vec<(String, String)>,
}

/// Reads `url` whose scheme is `plain` or `tls` (e.g. `sidekiq`/`sidekiqs`); the client
/// URL gets `redis`/`rediss` instead.
///
/// # Errors
/// [`SinkError::InvalidUrl`] for another scheme, a URL that does not parse or a TLS
/// setting that cannot be read.
pub(crate) fn split_url(url: &str, plain: &str, tls: &str) -> Result<RedisUrl, SinkError> {
    let invalid = |reason: String| SinkError::InvalidUrl {
        url: redact(url),
        reason,
    };
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let client_scheme = if scheme == plain {
        "redis"
    } else if scheme == tls {
        "rediss"
    } else {
        return Err(invalid(format!(
            "expected {plain}://HOST:PORT[/DB] or {tls}://…"
        )));
    };
    let mut parsed = url::Url::parse(&format!("{client_scheme}://{rest}"))
        .map_err(|e| invalid(e.to_string()))?;
    let files = super::tls::take_settings(&mut parsed).map_err(|e| invalid(e.to_string()))?;
    let mut kept = url::form_urlencoded::Serializer::new(String::new());
    let mut params = Vec::new();
    for (k, v) in parsed.query_pairs() {
        if k == "protocol" {
            kept.append_pair(&k, &v);
        } else {
            params.push((k.into_owned(), v.into_owned()));
        }
    }
    let kept = kept.finish();
    parsed.set_query(None);
    let mut client_url = parsed.to_string();
    // `url` writes `redis://h:1` as `redis://h:1/`; the database is the path's number.
    if client_url.ends_with('/') && parsed.path() == "/" {
        client_url.pop();
    }
    if !kept.is_empty() {
        client_url = format!("{client_url}?{kept}");
    }
    Ok(RedisUrl {
        client_url,
        files,
        params,
    })
}

/// A Redis server a sink writes to: the client, one multiplexed connection (made lazily,
/// kept, dropped after a failure) and the bounds on connecting and on each reply.
pub(crate) struct RedisServer {
    client: redis::Client,
    connect_timeout: Duration,
    response_timeout: Duration,
    connection: Mutex<Option<MultiplexedConnection>>,
    /// `rediss://HOST:PORT/DB` or `redis://…`: no credentials.
    pub(crate) address: String,
}

impl RedisServer {
    /// Builds the client for `parts` (`url` as the user wrote it, for errors) and tries to
    /// connect. A server that cannot be reached is not an error here: it is logged as
    /// `what`, and each batch retries the connection.
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] when the client refuses the URL or a TLS file cannot be
    /// read (or TLS files are named on a plain URL); [`SinkError::Open`] when the TLS
    /// handshake fails, the server refuses the credentials or wants some the URL does not
    /// give, or a plain URL names a port that speaks TLS.
    pub(crate) async fn open(
        url: &str,
        parts: &RedisUrl,
        connect_timeout: Duration,
        response_timeout: Duration,
        what: &str,
    ) -> Result<Self, SinkError> {
        let invalid = |reason: String| SinkError::InvalidUrl {
            url: redact(url),
            reason,
        };
        let files = &parts.files;
        let tls = parts.client_url.starts_with("rediss://");
        let client = if tls {
            super::tls::install_provider();
            let config = Arc::new(files.client_config().map_err(|e| invalid(e.to_string()))?);
            let certificates = redis::TlsCertificates {
                client_tls: files
                    .identity_pem()
                    .map_err(|e| invalid(e.to_string()))?
                    .map(|(client_cert, client_key)| redis::ClientTlsConfig {
                        client_cert,
                        client_key,
                    }),
                root_cert: files.ca_pem().map_err(|e| invalid(e.to_string()))?,
            };
            let client = redis::Client::build_with_tls(parts.client_url.as_str(), certificates)
                .map_err(|e| invalid(e.to_string()))?;
            let info = client.get_connection_info();
            if let redis::ConnectionAddr::TcpTls { host, port, .. } = info.addr() {
                super::tls::check_handshake(
                    host,
                    *port,
                    config,
                    super::tls::Preamble::None,
                    files.ca.as_deref(),
                )
                .await
                .map_err(|e| SinkError::Open {
                    url: redact(url),
                    source: Box::new(e),
                })?;
            }
            client
        } else {
            if files.named() {
                return Err(invalid(
                    "ca, cert and key need the TLS scheme (rediss://, sidekiqs://)".into(),
                ));
            }
            redis::Client::open(parts.client_url.as_str()).map_err(|e| invalid(e.to_string()))?
        };
        let info = client.get_connection_info();
        let address = format!(
            "{}://{}/{}",
            if tls { "rediss" } else { "redis" },
            info.addr(),
            info.redis_settings().db(),
        );
        let server = RedisServer {
            client,
            connect_timeout,
            response_timeout,
            connection: Mutex::new(None),
            address,
        };
        match server.open_connection().await {
            Ok(mut c) => {
                // A server that wants credentials the URL did not give answers the first
                // command with NOAUTH: that never gets better by retrying either.
                let ping: RedisResult<String> = redis::cmd("PING").query_async(&mut c).await;
                if let Err(e) = &ping
                    && (e.code() == Some("NOAUTH")
                        || e.kind() == redis::ErrorKind::AuthenticationFailed)
                {
                    return Err(SinkError::Open {
                        url: redact(url),
                        source: format!(
                            "the Redis server requires credentials the URL does not give (USER:PASS@, or password_file=): {e}"
                        )
                        .into(),
                    });
                }
                *server.connection.lock().await = Some(c);
            }
            // Wrong credentials never get better by retrying: say so now.
            Err(e)
                if e.kind() == redis::ErrorKind::AuthenticationFailed
                    || e.code() == Some("WRONGPASS")
                    || e.code() == Some("NOAUTH") =>
            {
                return Err(SinkError::Open {
                    url: redact(url),
                    source: format!("the Redis server refused the credentials: {e}").into(),
                });
            }
            Err(e) => {
                if let redis::ConnectionAddr::Tcp(host, port) =
                    server.client.get_connection_info().addr()
                    && super::tls::speaks_tls(host, *port).await
                {
                    let scheme = url.split_once("://").map_or("rediss", |(s, _)| s);
                    return Err(SinkError::Open {
                        url: redact(url),
                        source: format!("{host}:{port} speaks TLS: use {scheme}s:// ({e})").into(),
                    });
                }
                tracing::warn!(sink = %what, error = %e, "Redis not reachable yet; each batch will retry");
            }
        }
        Ok(server)
    }

    /// A server for `client_url` that has not been contacted (for tests of what a sink
    /// builds without Redis).
    #[cfg(test)]
    pub(crate) fn unconnected(client_url: &str) -> RedisResult<Self> {
        Ok(RedisServer {
            client: redis::Client::open(client_url)?,
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            connection: Mutex::new(None),
            address: client_url.to_owned(),
        })
    }

    /// The current connection, or a new one.
    pub(crate) async fn connection(&self) -> Result<MultiplexedConnection, PublishError> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = self.open_connection().await.map_err(|e| {
            PublishError::unavailable(format!("cannot connect to {}: {e}", self.address))
                .with_code(PublishCode::NotConnected)
        })?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// A new connection, within the connect and response timeouts.
    async fn open_connection(&self) -> RedisResult<MultiplexedConnection> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.response_timeout));
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    /// Forgets the connection, so the next batch makes a new one.
    pub(crate) async fn reset(&self) {
        *self.connection.lock().await = None;
    }
}

/// What a failed write command means, as the sinks report it: `command` names it for
/// the text (`XADD to "orders"`, `LPUSH queue:mailers`), `wrong_type` is the permanent
/// error for `WRONGTYPE` (the key holds another type).
pub(crate) fn classify_reply(e: &RedisError, command: &str, wrong_type: String) -> PublishError {
    let code = e.code().unwrap_or("");
    let text = e.to_string();
    match code {
        "WRONGTYPE" => PublishError::permanent(wrong_type).with_code(PublishCode::WrongType),
        "NOPERM" => PublishError::permanent(format!("Redis refused {command}: {text}"))
            .with_code(PublishCode::NotAuthorized),
        // Not authenticated at all: the sink's credentials, not the message.
        "NOAUTH" => PublishError::unavailable(format!(
            "Redis wants authentication (put the password in the sink URL): {text}"
        ))
        .with_code(PublishCode::NotAuthorized),
        "OOM" | "LOADING" | "BUSY" | "MISCONF" | "READONLY" | "MASTERDOWN" | "TRYAGAIN"
        | "CLUSTERDOWN" | "MOVED" | "ASK" => {
            PublishError::unavailable(format!("Redis cannot take writes now: {text}"))
                .with_code(PublishCode::DestinationBusy)
        }
        // No reply within the response timeout: judged by the router like any timeout.
        _ if e.is_timeout() => PublishError::timed_out(format!("Redis did not reply: {text}")),
        _ if e.is_io_error() || e.is_connection_dropped() => {
            PublishError::unavailable(format!("Redis connection failed: {text}"))
                .with_code(PublishCode::NotConnected)
        }
        _ => PublishError::transient(format!("Redis {command}: {text}")),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_client_url_keeps_the_connection_and_protocol_only() {
        let u = split_url(
            "sidekiq://:pw@127.0.0.1:6379/3?queue=q&class=C",
            "sidekiq",
            "sidekiqs",
        )
        .unwrap();
        assert_eq!(u.client_url, "redis://:pw@127.0.0.1:6379/3");
        assert_eq!(
            u.params,
            vec![("queue".into(), "q".into()), ("class".into(), "C".into())]
        );
        let u = split_url("redis://h:1?protocol=resp3&maxlen=5", "redis", "rediss").unwrap();
        assert_eq!(u.client_url, "redis://h:1?protocol=resp3");
        let u = split_url("sidekiqs://h:6380?ca=/etc/ca.pem", "sidekiq", "sidekiqs").unwrap();
        assert_eq!(u.client_url, "rediss://h:6380");
        assert_eq!(
            u.files.ca.as_deref(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
        assert!(split_url("redis://h:1", "sidekiq", "sidekiqs").is_err());
    }
}
