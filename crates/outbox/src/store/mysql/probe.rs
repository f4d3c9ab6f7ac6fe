//! The wake-up probe: MySQL has no notification, so a background task polls the newest
//! id and the first live row's time, wakes relays on a change and tells them when
//! nothing is claimable.

use super::MySqlStore;
use std::time::Duration;
use tokio::sync::watch;

/// The wake-up probe's interval (one statement each: `MAX(id)` from the primary key and
/// `MIN(live_at)` from the live index, both single index reads): 5 ms right after a change,
/// growing by half each quiet probe up to 200 ms, and up to [`PROBE_IDLE`] once nothing
/// has changed for [`PROBE_QUIET`]. MySQL has no notification, so this bounds how soon a
/// commit wakes an idle relay: ≤ 200 ms in the first 10 s after a change, ≤ 1 s after.
const PROBE_MIN: Duration = Duration::from_millis(5);
const PROBE_MAX: Duration = Duration::from_millis(200);
/// The probe's interval after [`PROBE_QUIET`] without a change: the relay's default poll
/// interval, so a long-idle relay runs one statement per second to find new rows. A relay
/// polling more often lowers every cap to its poll interval (see [`Relaying::nothing_due`](crate::store::Relaying::nothing_due)),
/// so a commit waits no longer than with a claim per poll.
const PROBE_IDLE: Duration = Duration::from_secs(1);
const PROBE_QUIET: Duration = Duration::from_secs(10);

/// What the wake-up probe last saw, for [`Relaying::nothing_due`](crate::store::Relaying::nothing_due).
pub(super) struct Quiet {
    /// Writes through this store that can make rows due (settle, replay, give-back),
    /// counted as each ends: a probe that began before one ended may not have seen it.
    writes: std::sync::atomic::AtomicU64,
    /// `writes` when the last successful probe began, and the instant before which it
    /// found no row claimable.
    seen: std::sync::Mutex<Option<(u64, std::time::Instant)>>,
    /// The shortest poll interval a relay skipping claims on the probe's word asked with
    /// (ms; `u64::MAX` until one asks): the probe never waits longer than that.
    poll_ms: std::sync::atomic::AtomicU64,
}

impl Default for Quiet {
    fn default() -> Self {
        Quiet {
            writes: Default::default(),
            seen: Default::default(),
            poll_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
        }
    }
}

impl Quiet {
    fn seen(&self) -> std::sync::MutexGuard<'_, Option<(u64, std::time::Instant)>> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// See [`Relaying::nothing_due`](crate::store::Relaying::nothing_due); `poll_interval` caps the probe's quiet interval.
    fn nothing_due(&self, poll_interval: Duration) -> bool {
        let ms = u64::try_from(poll_interval.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        self.poll_ms
            .fetch_min(ms, std::sync::atomic::Ordering::Relaxed);
        let writes = self.writes.load(std::sync::atomic::Ordering::SeqCst);
        self.seen()
            .is_some_and(|(w, until)| w == writes && std::time::Instant::now() < until)
    }

    /// Counts a write when the returned guard drops (declare it first, so it drops after
    /// the write's transaction).
    pub(super) fn writing(&self) -> WriteEnd<'_> {
        WriteEnd(self)
    }
}

/// Until when a probe that began at `at` and found the first live row `next_us` µs away
/// (≤ 0: due now; `None`: no live row) says nothing is claimable: measured from the
/// probe's start, so never later than the database's view, and never more than
/// [`QUIET_VALID`] past it, so an answer from a probe that hangs (a connection that went
/// silent) lapses and the relay claims on its poll again.
fn quiet_until(at: std::time::Instant, next_us: Option<i64>) -> Option<std::time::Instant> {
    match next_us {
        None => Some(at + QUIET_VALID),
        Some(us) if us > 0 => Some(at + Duration::from_micros(us.unsigned_abs()).min(QUIET_VALID)),
        Some(_) => None,
    }
}

/// How long one probe's "nothing claimable" holds: twice its longest interval.
const QUIET_VALID: Duration = Duration::from_secs(2);

pub(super) struct WriteEnd<'a>(&'a Quiet);

impl Drop for WriteEnd<'_> {
    fn drop(&mut self) {
        self.0
            .writes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl MySqlStore {
    pub(super) fn subscribe_wakeups(&self) -> watch::Receiver<u64> {
        self.start_watcher();
        self.inner.wakeup.subscribe()
    }

    pub(super) fn probe_says_nothing_due(&self, poll_interval: Duration) -> bool {
        self.inner.quiet.nothing_due(poll_interval)
    }

    /// The wake-up probe (see [`PROBE_MIN`]). It moves the counter when the newest id
    /// changes (a commit of new rows) and when rows become due after a probe that found
    /// none (a retry's backoff or a lease ran out, a replay, a release), and records in
    /// `quiet` until when nothing is claimable, so an idle relay's poll costs no claim.
    fn start_watcher(&self) {
        let pool = self.inner.pool.clone();
        let sql = self.inner.sql.probe.clone();
        let quiet = self.inner.quiet.clone();
        self.inner.wakeup.start_once(|wake| async move {
            let mut last: Option<i64> = None;
            let mut was_due = false;
            let mut interval = PROBE_MIN;
            let mut changed = std::time::Instant::now();
            loop {
                tokio::time::sleep(interval).await;
                let writes = quiet.writes.load(std::sync::atomic::Ordering::SeqCst);
                let at = std::time::Instant::now();
                let seen = sqlx::query_as::<_, (i64, Option<i64>)>(sql.clone())
                    .fetch_one(&pool)
                    .await;
                let Ok((max, next_us)) = seen else {
                    *quiet.seen() = None;
                    interval = Duration::from_secs(1);
                    continue;
                };
                let due = next_us.is_some_and(|us| us <= 0);
                *quiet.seen() = quiet_until(at, next_us).map(|u| (writes, u));
                let new_rows = last.is_some_and(|l| l != max);
                if new_rows || (due && !was_due) {
                    if last.is_some() {
                        wake.bump();
                    }
                    changed = at;
                    interval = PROBE_MIN;
                } else if last.is_none() {
                    interval = PROBE_MIN;
                } else {
                    let poll = Duration::from_millis(
                        quiet.poll_ms.load(std::sync::atomic::Ordering::Relaxed),
                    );
                    let cap = if changed.elapsed() < PROBE_QUIET {
                        PROBE_MAX
                    } else {
                        PROBE_IDLE
                    }
                    .min(poll);
                    interval = (interval * 3 / 2).min(cap);
                }
                last = Some(max);
                was_due = due;
            }
        });
    }
}

#[cfg(test)]
mod quiet_tests {
    use super::{QUIET_VALID, quiet_until};
    use std::time::{Duration, Instant};

    #[test]
    fn a_probe_answer_lapses_even_when_nothing_is_live_or_due_for_long() {
        let at = Instant::now();
        assert_eq!(quiet_until(at, None), Some(at + QUIET_VALID));
        // A parked row (due in 8,000 years) or a far retry: still at most QUIET_VALID.
        assert_eq!(quiet_until(at, Some(i64::MAX)), Some(at + QUIET_VALID));
        assert_eq!(
            quiet_until(at, Some(300_000)),
            Some(at + Duration::from_millis(300))
        );
        assert_eq!(quiet_until(at, Some(0)), None);
        assert_eq!(quiet_until(at, Some(-5)), None);
    }
}
