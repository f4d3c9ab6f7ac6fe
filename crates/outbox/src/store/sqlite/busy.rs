//! The busy handler of the store's connections: how a statement waits for another
//! writer's lock, retrying every millisecond at first, until the busy timeout.

use std::ffi::{c_int, c_void};
use std::time::Duration;

/// [`busy_step`]'s schedule: a retry every 1 ms for the first [`BUSY_FAST_TRIES`] tries
/// (about 100 ms), then every 10 ms, giving up after [`BUSY_TIMEOUT`] of summed sleeps.
const BUSY_FAST_TRIES: u64 = 100;
const BUSY_SLOW_STEP_MS: u64 = 10;
/// The busy timeout of [`connect_options`](super::connect_options): how long a statement
/// waits for another writer's lock before it fails with `SQLITE_BUSY`.
pub(super) const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The busy handler of the store's connections
/// (<https://www.sqlite.org/c3ref/busy_handler.html>): `tries` is how often it ran for
/// this wait; nonzero means retry. SQLite's own (`sqlite3_busy_timeout`) sleeps 1, 2, 5,
/// 10, 15, 20, 25, 25, 25, 50, 50, 100 ms between tries, so a claim woken while another
/// process's commit is still syncing found the lock free up to 25 ms late; this one
/// retries every 1 ms for about 100 ms, then every 10 ms, and gives up after
/// [`BUSY_TIMEOUT`].
pub(super) unsafe extern "C" fn busy_step(_: *mut c_void, tries: c_int) -> c_int {
    match busy_sleep(u64::try_from(tries).unwrap_or(0)) {
        Some(step) => {
            std::thread::sleep(step);
            1
        }
        None => 0,
    }
}

/// [`busy_step`]'s schedule: the sleep before retry number `tries + 1`, or `None` once the
/// sleeps so far add up to [`BUSY_TIMEOUT`].
pub(super) fn busy_sleep(tries: u64) -> Option<Duration> {
    let slept_ms =
        tries.min(BUSY_FAST_TRIES) + tries.saturating_sub(BUSY_FAST_TRIES) * BUSY_SLOW_STEP_MS;
    if u128::from(slept_ms) >= BUSY_TIMEOUT.as_millis() {
        return None;
    }
    let step = if tries < BUSY_FAST_TRIES {
        1
    } else {
        BUSY_SLOW_STEP_MS
    };
    Some(Duration::from_millis(step))
}
