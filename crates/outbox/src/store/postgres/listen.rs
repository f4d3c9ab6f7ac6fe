//! Wake-ups: the `LISTEN` loop that moves the relays' wake-up counter.

use super::PgStore;
use sqlx::postgres::{PgListener, PgPoolOptions};
use std::time::Duration;

impl PgStore {
    pub(super) fn start_listener(&self) {
        let Some(url) = self.inner.url.clone() else {
            return;
        };
        let channel = format!("{}_messages", self.inner.config.schema);
        self.inner
            .wakeup
            .start_once(|bump| listen_loop(url, channel, bump));
    }
}

/// Connects the listener: a pool of one connection of its own whose acquire (connection
/// included) is bounded by [`crate::store::ACQUIRE_TIMEOUT`], then `LISTEN`. The listener does not
/// reconnect by itself (`eager_reconnect(false)`): [`listen_loop`] does, so that it can say
/// so.
pub(super) async fn listen(
    url: &str,
    channel: &str,
) -> std::result::Result<PgListener, sqlx::Error> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(crate::store::ACQUIRE_TIMEOUT)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy(url)?;
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.eager_reconnect(false);
    listener.listen(channel).await?;
    Ok(listener)
}

/// Forwards notifications to `wake` and keeps the listener connected. A loss (or a first
/// connection that fails) is logged once as a warning, and the reconnection once, with the
/// outage's length; the attempts in between are silent (capped backoff, 100 ms doubling to
/// 30 s), so an outage of any length costs two log lines. The backoff is reset only by a
/// connection that stayed up for a while, so a connection that keeps dropping at once
/// logs at most twice per 30 s. Every (re)connect and every loss wakes the relay, since
/// notifications sent while disconnected are lost; relays poll meanwhile.
pub(super) async fn listen_loop(url: String, channel: String, wake: crate::store::Bump) {
    const FIRST_DELAY: Duration = Duration::from_millis(100);
    const MAX_DELAY: Duration = Duration::from_secs(30);
    let mut delay = FIRST_DELAY;
    let mut lost_since: Option<std::time::Instant> = None;
    loop {
        let mut listener = match listen(&url, &channel).await {
            Ok(l) => l,
            Err(e) => {
                if lost_since.is_none() {
                    tracing::warn!(error = %e, "outbox listener cannot connect; relays poll until it is back");
                    lost_since = Some(std::time::Instant::now());
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_DELAY);
                continue;
            }
        };
        if let Some(since) = lost_since.take() {
            tracing::info!(outage = ?since.elapsed(), "outbox listener reconnected");
        }
        let connected_at = std::time::Instant::now();
        wake.bump();
        let why = loop {
            match listener.try_recv().await {
                Ok(Some(_)) => wake.bump(),
                Ok(None) => break "the connection was closed".to_owned(),
                Err(e) => break e.to_string(),
            }
        };
        drop(listener);
        tracing::warn!(error = %why, "outbox listener lost its connection; relays poll until it is back");
        lost_since = Some(std::time::Instant::now());
        wake.bump();
        if connected_at.elapsed() >= MAX_DELAY {
            delay = FIRST_DELAY;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(MAX_DELAY);
    }
}
