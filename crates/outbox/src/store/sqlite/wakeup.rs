//! Wake-ups: the hooks of the store's own connections, whose WAL hook moves the counter
//! once a commit that matters has ended (and checkpoints as SQLite's own hook does), and
//! the watch on the database and WAL files for every other process's commits (inotify, or
//! a `stat` poll where the OS cannot notify).

use super::SqliteStore;
use super::busy::busy_step;
use libsqlite3_sys as ffi;
use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// When the OS cannot notify (no inotify watch could be added), how often the wake-up
/// watcher looks at the database and WAL files instead (one `stat` each): every 2 ms right
/// after a change, slowing by half each quiet look to every 20 ms.
const WATCH_MIN: Duration = Duration::from_millis(2);
const WATCH_MAX: Duration = Duration::from_millis(20);

impl SqliteStore {
    /// Watches the database and its WAL for commits by any process: every commit appends
    /// to the WAL (or, after a checkpoint, writes the database file). The OS tells us
    /// (inotify on Linux, through the `notify` crate: no work while nothing changes);
    /// where no watch can be added, a `stat` of both files every few milliseconds does.
    pub(super) fn start_watcher(&self) {
        let db = self.inner.options.get_filename().to_path_buf();
        let mut wal = db.clone().into_os_string();
        wal.push("-wal");
        let files = [db, std::path::PathBuf::from(wal)];
        self.inner.wakeup.start_once(|wake| async move {
            match notify_watcher(&files, wake.clone()) {
                Ok(watcher) => {
                    // The watcher's own thread bumps the counter; keep it alive.
                    let _watcher = watcher;
                    std::future::pending::<()>().await;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "no file notifications for the SQLite database: polling its files");
                    poll_files(&files, &wake).await;
                }
            }
        });
    }
}

/// Installs, on one pool connection, the hooks that wake this process's relays when a
/// transaction that inserted into `{p}_messages` (or changed a pause) commits, and the
/// busy handler that hands the write lock over within about a millisecond.
///
/// - The update hook notes the write; the rollback hook forgets it.
/// - In WAL mode (every file database of [`SqliteStore::connect`]) the WAL hook moves the
///   counter: SQLite calls it after the commit, once the write lock is released
///   (<https://www.sqlite.org/c3ref/wal_hook.html>), so the claim it starts finds the rows
///   and the lock free. The WAL hook is also SQLite's auto-checkpoint
///   (<https://www.sqlite.org/c3ref/wal_autocheckpoint.html>): ours checkpoints as the
///   default does, passively once the WAL holds [`AUTOCHECKPOINT_PAGES`].
/// - Without a WAL (an in-memory database) the commit hook moves it, just before the
///   commit ends.
///
/// SQLite runs the WAL hook when a statement's step completes the commit, not when a
/// reset does: an autocommit write whose rows are read only in part (`INSERT …
/// RETURNING` through sqlx's `fetch_one` or `fetch_optional`, which reset the statement
/// after one row) moves no counter here. The store's own writes run to completion; for
/// such a write on [`SqliteStore::pool`] the file watch, which runs for every relay of the
/// store, wakes the relays (as for another process's commit).
pub(super) async fn wake_on_commit(
    conn: &mut sqlx::SqliteConnection,
    p: &str,
    bump: crate::store::Bump,
) {
    let wal = sqlx::query_scalar::<_, String>("PRAGMA journal_mode")
        .fetch_one(&mut *conn)
        .await
        .is_ok_and(|m| m.eq_ignore_ascii_case("wal"));
    let Ok(mut handle) = conn.lock_handle().await else {
        return;
    };
    let commits = Arc::new(Commits {
        wrote: AtomicBool::new(false),
        bump,
    });
    let (messages, control, pauses) = (
        format!("{p}_messages"),
        format!("{p}_control"),
        format!("{p}_topic_pauses"),
    );
    let noted = commits.clone();
    handle.set_update_hook(move |change| {
        let insert = matches!(change.operation, sqlx::sqlite::SqliteOperation::Insert);
        if (insert && change.table == messages) || change.table == control || change.table == pauses
        {
            noted.wrote.store(true, Ordering::Relaxed);
        }
    });
    let forgot = commits.clone();
    handle.set_rollback_hook(move || forgot.wrote.store(false, Ordering::Relaxed));
    let db = handle.as_raw_handle();
    // SAFETY: `db` is this connection's open handle, locked by `handle`. The handler keeps
    // no state.
    unsafe { ffi::sqlite3_busy_handler(db.as_ptr(), Some(busy_step), std::ptr::null_mut()) };
    if !wal {
        handle.set_commit_hook(move || {
            commits.wake();
            true
        });
        return;
    }
    let hook = WalHook::install(db, commits);
    // The commit hook owns the WAL hook's state: sqlx drops it when the hook is replaced or
    // the connection closes, and `WalHook`'s drop unregisters the WAL hook first.
    handle.set_commit_hook(move || {
        let _ = &hook;
        true
    });
}

/// SQLite's default auto-checkpoint threshold, in WAL pages, which [`after_commit`] keeps
/// (<https://www.sqlite.org/pragma.html#pragma_wal_autocheckpoint>).
pub(super) const AUTOCHECKPOINT_PAGES: c_int = 1000;

/// What the hooks of one connection share: whether the open transaction wrote rows that
/// may wake a relay, and the counter its commit moves.
struct Commits {
    wrote: AtomicBool,
    bump: crate::store::Bump,
}

impl Commits {
    fn wake(&self) {
        if self.wrote.swap(false, Ordering::Relaxed) {
            self.bump.bump();
        }
    }
}

/// The WAL hook of one connection, registered with a pointer to `commits`, which this
/// value keeps alive; dropping it puts SQLite's own auto-checkpoint hook back.
struct WalHook {
    db: std::ptr::NonNull<ffi::sqlite3>,
    _commits: Arc<Commits>,
}

// SAFETY: the handle is used only to replace the connection's WAL hook, which SQLite
// serialises on the connection's mutex (sqlx opens connections with
// `SQLITE_OPEN_FULLMUTEX`).
unsafe impl Send for WalHook {}

impl WalHook {
    fn install(db: std::ptr::NonNull<ffi::sqlite3>, commits: Arc<Commits>) -> Self {
        // SAFETY: `db` is open; the pointer stays valid while the returned value lives, and
        // its drop unregisters the hook before the `Arc` is released.
        unsafe {
            ffi::sqlite3_wal_hook(
                db.as_ptr(),
                Some(after_commit),
                Arc::as_ptr(&commits).cast_mut().cast(),
            );
        }
        WalHook {
            db,
            _commits: commits,
        }
    }
}

impl Drop for WalHook {
    fn drop(&mut self) {
        // SAFETY: the owner is the connection's commit hook, which sqlx drops while the
        // connection is open (when the hook is replaced, or before `sqlite3_close`).
        unsafe { ffi::sqlite3_wal_autocheckpoint(self.db.as_ptr(), AUTOCHECKPOINT_PAGES) };
    }
}

/// The WAL hook: the commit is durable and the write lock released, so wake the relays
/// (when the transaction wrote rows that matter), then checkpoint as SQLite's default hook
/// does once the WAL holds [`AUTOCHECKPOINT_PAGES`] pages.
unsafe extern "C" fn after_commit(
    commits: *mut c_void,
    db: *mut ffi::sqlite3,
    name: *const c_char,
    pages: c_int,
) -> c_int {
    // SAFETY: `commits` is the pointer a live `WalHook` registered.
    let commits = unsafe { &*commits.cast::<Commits>().cast_const() };
    commits.wake();
    if pages >= AUTOCHECKPOINT_PAGES {
        // SAFETY: SQLite passes its open handle and the database's name; a passive
        // checkpoint from the hook is what its default hook does.
        unsafe { ffi::sqlite3_wal_checkpoint(db, name) };
    }
    ffi::SQLITE_OK
}

/// An OS watch on the directory of `files` that bumps `wake` when one of them is written.
fn notify_watcher(
    files: &[std::path::PathBuf; 2],
    wake: crate::store::Bump,
) -> notify::Result<notify::RecommendedWatcher> {
    use notify::Watcher;
    let dir = match files[0].parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
    let names: Vec<std::ffi::OsString> = files
        .iter()
        .filter_map(|f| f.file_name().map(std::ffi::OsStr::to_os_string))
        .collect();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else {
            // The watch failed: something may have changed.
            wake.bump();
            return;
        };
        // The OS dropped events (inotify's queue overflowed): something changed.
        if event.need_rescan() {
            wake.bump();
            return;
        }
        let written = matches!(
            event.kind,
            notify::EventKind::Modify(_) | notify::EventKind::Create(_) | notify::EventKind::Any
        );
        if written
            && event
                .paths
                .iter()
                .any(|p| p.file_name().is_some_and(|n| names.iter().any(|f| f == n)))
        {
            wake.bump();
        }
    })?;
    watcher.watch(&dir, notify::RecursiveMode::NonRecursive)?;
    Ok(watcher)
}

/// The fallback watch: size and modification time of `files`, looked at every 2–20 ms.
async fn poll_files(files: &[std::path::PathBuf; 2], wake: &crate::store::Bump) {
    let look = || {
        files
            .iter()
            .map(|f| {
                std::fs::metadata(f)
                    .ok()
                    .map(|m| (m.len(), m.modified().ok()))
            })
            .collect::<Vec<_>>()
    };
    let mut last = look();
    let mut interval = WATCH_MIN;
    loop {
        tokio::time::sleep(interval).await;
        let now = look();
        if now != last {
            wake.bump();
            last = now;
            interval = WATCH_MIN;
        } else {
            interval = (interval * 3 / 2).min(WATCH_MAX);
        }
    }
}
