//! The relay's id: refused at start while another live relay holds it (in this program by
//! the [`RUNNING`] list, elsewhere by the registry), the registry row written at each
//! heartbeat, and the check made there.

use super::{Relay, RelayError};

impl Relay {
    /// Refuses to start when a live relay of another process already uses this relay's
    /// id ([`RelayError::IdTaken`]). A registry that cannot be read does not stop the
    /// relay (the heartbeat checks again).
    pub(super) async fn refuse_if_id_taken(&self) -> Result<Running, RelayError> {
        let host = host_name();
        let running = Running::enter(&self.config.relay_id, &self.instance).map_err(|_| {
            RelayError::IdTaken {
                relay_id: self.config.relay_id.clone(),
                host: host.clone(),
                pid: i64::from(std::process::id()),
                seen_ago_s: 0.0,
            }
        })?;
        if self.config.heartbeat_interval.is_zero() {
            return Ok(running);
        }
        let Ok(relays) = self.store.relays(crate::store::RELAY_EXPIRY).await else {
            return Ok(running);
        };
        if let Some(other) = id_holder(&relays, &self.config.relay_id, &self.instance, &host) {
            return Err(RelayError::IdTaken {
                relay_id: self.config.relay_id.clone(),
                host: other.host.clone(),
                pid: other.pid,
                seen_ago_s: other.last_seen_ago_s,
            });
        }
        // The rows of this id left by processes of this host that are gone (a kill -9
        // and a restart): not a second relay, so not listed as one.
        for gone in relays.iter().filter(|r| {
            r.relay_id == self.config.relay_id && r.instance != self.instance && gone(r, &host)
        }) {
            let _ = self.store.deregister(&gone.relay_id, &gone.instance).await;
        }
        // Registered before the first claim: the row's `started_at` precedes every claim
        // of this instance, which tells its claims from an earlier process's.
        let _ = self.store.heartbeat(&self.beat(&host)).await;
        Ok(running)
    }

    /// The registry row this relay writes at a heartbeat.
    pub(super) fn beat(&self, host: &str) -> crate::store::RelayHeartbeat {
        crate::store::RelayHeartbeat {
            relay_id: self.config.relay_id.clone(),
            instance: self.instance.clone(),
            host: host.to_owned(),
            pid: i64::from(std::process::id()),
            lease: self.config.lease,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            sink: self.router.describe(),
            in_flight: self.health.in_flight(),
            last_claim_ago: self.health.since_last_claim(),
            destinations: self
                .router
                .destination_states()
                .into_iter()
                .map(|(name, state)| crate::store::DestinationState {
                    name,
                    state: state.to_owned(),
                })
                .collect(),
        }
    }

    /// At a heartbeat: logs an ERROR and counts `outbox_relay_id_conflicts_total` when the
    /// registry row of this relay's id was last written by another live process (two
    /// relays started under one id at the same moment both passed the start check, or one
    /// was started with heartbeats off). Both keep running; the operator renames one.
    pub(super) async fn check_id_at_heartbeat(&self, host: &str) {
        let Ok(relays) = self.store.relays(crate::store::RELAY_EXPIRY).await else {
            return;
        };
        if let Some(other) = id_holder(&relays, &self.config.relay_id, &self.instance, host) {
            crate::metrics::add(crate::metrics::RELAY_ID_CONFLICTS, 1);
            tracing::error!(
                relay_id = %self.config.relay_id,
                other_host = %other.host,
                other_pid = other.pid,
                "another live relay runs under this relay id: the registry shows the two as one and their claims cannot be told apart; give each relay its own --relay-id"
            );
        }
    }
}

/// The live registry row of `relay_id` that another relay instance wrote, if any: not
/// this one (`instance`; another `Relay` of this process counts), and not a process of
/// this host that is gone ([`gone`]).
fn id_holder<'a>(
    relays: &'a [crate::store::RelayRecord],
    relay_id: &str,
    instance: &str,
    host: &str,
) -> Option<&'a crate::store::RelayRecord> {
    relays
        .iter()
        .find(|r| r.relay_id == relay_id && r.instance != instance && !gone(r, host))
}

/// Whether the registry row was written by a process of this host (`host`) that no longer
/// runs: a registry row outlives a `kill -9` by up to its expiry. A row of this pid is
/// gone unless its instance runs in this process (a restarted process may get the pid of
/// the one that died, as a container's first process does); for another pid, `/proc`
/// tells whether it still runs, where there is one.
fn gone(r: &crate::store::RelayRecord, host: &str) -> bool {
    if r.host != host {
        return false;
    }
    if r.pid == i64::from(std::process::id()) {
        return !Running::runs(&r.instance);
    }
    std::path::Path::new("/proc/self").exists()
        && !std::path::Path::new(&format!("/proc/{}", r.pid)).exists()
}

/// The relays running in this process, as (relay id, instance): a second `Relay` of this
/// program under a relay id already running here is refused at once, whatever the
/// registry says (heartbeats off, or the first one's row not written yet).
static RUNNING: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// A relay's entry in [`RUNNING`], removed when its run ends.
pub(super) struct Running(String);

impl Running {
    /// Enters `instance` under `relay_id`; `Err` when another instance of this process
    /// runs under that id.
    fn enter(relay_id: &str, instance: &str) -> Result<Running, ()> {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        if running
            .iter()
            .any(|(id, i)| id == relay_id && i != instance)
        {
            return Err(());
        }
        running.push((relay_id.to_owned(), instance.to_owned()));
        Ok(Running(instance.to_owned()))
    }

    /// Whether `instance` runs in this process.
    fn runs(instance: &str) -> bool {
        RUNNING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(_, i)| i == instance)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(_, i)| *i != self.0);
    }
}

/// This host's name (`HOSTNAME`, else `/etc/hostname`, else `localhost`).
pub(super) fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
