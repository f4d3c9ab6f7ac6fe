//! One module per command: each holds its clap arguments and its `run` (the demo is
//! `crate::demo`). The flags several commands share are here.

pub(crate) mod change;
pub(crate) mod dead;
pub(crate) mod enqueue;
pub(crate) mod inbox;
pub(crate) mod migrate;
pub(crate) mod pause;
pub(crate) mod purge;
pub(crate) mod relay;
pub(crate) mod replay;
pub(crate) mod replays;
pub(crate) mod resume;
pub(crate) mod serve;
pub(crate) mod status;

/// Per-key ordering, as `relay`, `status` and `dead list` take it (one setting, the
/// same `OUTBOX_ORDERED` for all three).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct OrderingArgs {
    /// Per-key ordering for topics matching PATTERN (repeatable; `*` one token, `>` one
    /// or more at the end): the messages of one topic and key are published in id order,
    /// one after another, while other keys flow in parallel; messages without a key are
    /// never held back. A message that fails holds back only its key; a dead one blocks
    /// its key until replayed or discarded (see --ordered-skip-dead). Every relay of the
    /// outbox, and status and dead list, must be given the same patterns. In
    /// OUTBOX_ORDERED, separate patterns by spaces.
    #[arg(long = "ordered", env = "OUTBOX_ORDERED", value_delimiter = ' ', value_parser = outbox::sink::router::TopicPattern::parse)]
    pub(crate) ordered: Vec<outbox::sink::router::TopicPattern>,
    /// With --ordered: a dead message does not block its key; the later messages go on
    /// and the gap stays in the dead letters (availability over order).
    #[arg(long, env = "OUTBOX_ORDERED_SKIP_DEAD", requires = "ordered")]
    pub(crate) ordered_skip_dead: bool,
}

impl OrderingArgs {
    /// The ordering these flags give.
    pub(crate) fn ordering(&self) -> outbox::store::KeyOrdering {
        outbox::store::KeyOrdering {
            topics: self.ordered.clone(),
            skip_dead: self.ordered_skip_dead,
        }
    }
}

/// Who does an audited change (`pause`, `resume`, `replay`, `dead discard`, `purge
/// --dead-older-than`): `--by`, by default the user running the command.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ByArgs {
    /// Who, for the audit (`outbox replays`, `status`); by default the user running the
    /// command: $USER, else $LOGNAME, else the name of its user id.
    #[arg(long, value_name = "NAME", default_value_t = os_user())]
    pub(crate) by: String,
}

/// The user running the command: `$USER`, else `$LOGNAME`, else the name the user
/// database gives the process's user id (as `id -un`), else `unknown`.
pub(crate) fn os_user() -> String {
    ["USER", "LOGNAME"]
        .into_iter()
        .filter_map(|var| std::env::var(var).ok())
        .map(|name| name.trim().to_owned())
        .find(|name| !name.is_empty())
        .or_else(uid_name)
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The login name of the process's real user id, from the user database (`getpwuid_r`).
#[cfg(unix)]
fn uid_name() -> Option<String> {
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: `passwd` is plain data (integers and pointers); zeroed is a valid value
    // that getpwuid_r overwrites.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is to a live local of the size passed; getpwuid_r writes the
    // strings into `buf` and sets `found` to `&entry` or null.
    let rc = unsafe {
        libc::getpwuid_r(
            libc::getuid(),
            &raw mut entry,
            buf.as_mut_ptr(),
            buf.len(),
            &raw mut found,
        )
    };
    if rc != 0 || found.is_null() || entry.pw_name.is_null() {
        return None;
    }
    // SAFETY: on success pw_name points to a NUL-terminated string inside `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(entry.pw_name) };
    Some(name.to_string_lossy().trim().to_owned()).filter(|n| !n.is_empty())
}

#[cfg(not(unix))]
fn uid_name() -> Option<String> {
    None
}
