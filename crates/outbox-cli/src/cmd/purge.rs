//! `outbox purge`: delete old dispatched rows in bounded batches, or (with
//! `--dead-older-than`) old dead rows as one audited operation.

use crate::shared::{
    CONFIRM_ABOVE, GlobalArgs, confirm, humantime_fmt, open_checked, out, parse_duration,
};
use crate::text::counted;
use outbox::store::prelude::*;
use outbox::store::{DeadSelector, ReplayAction, ReplayRequest, Store};
use std::process::ExitCode;
use std::time::Duration;

/// `outbox purge`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Delete dead rows that died longer ago than this (30d), as one audited
    /// operation, instead of dispatched rows.
    #[arg(long, value_parser = parse_duration)]
    dead_older_than: Option<Duration>,
    #[command(flatten)]
    by: super::ByArgs,
    /// Delete more than 1,000 rows without asking (a prompt on a terminal; a script
    /// without it is refused: a scheduled purge passes --yes).
    #[arg(long)]
    yes: bool,
    /// Keep dispatched rows younger than this (e.g. 7d, 36h, 90m) [default: 7d].
    #[arg(long, env = "OUTBOX_RETENTION", value_parser = parse_duration)]
    older_than: Option<Duration>,
    /// The retention in seconds: the earlier spelling of --older-than (OUTBOX_RETENTION_S
    /// and `retention-s` in outbox.toml are still read, as seconds).
    #[arg(long, value_name = "SECONDS", hide = true)]
    older_than_s: Option<u64>,
    /// Rows per delete statement.
    #[arg(long, env = "OUTBOX_PURGE_BATCH_SIZE", default_value_t = 1_000)]
    batch_size: u32,
    /// Pause between batches, in ms (gives producers room on a busy database).
    #[arg(long, env = "OUTBOX_PURGE_PAUSE_MS", default_value_t = 0)]
    pause_ms: u64,
}

/// Runs `outbox purge`.
pub(crate) async fn run(global: &GlobalArgs, args: &Args) -> anyhow::Result<ExitCode> {
    let Args {
        dead_older_than,
        by,
        yes,
        older_than,
        older_than_s,
        batch_size,
        pause_ms,
    } = args;
    let by = &by.by;
    let store = open_checked(global).await?;
    anyhow::ensure!(*batch_size > 0, "--batch-size must be at least 1");
    if let Some(age) = dead_older_than {
        let reason = format!(
            "dead-row retention: died more than {} ago",
            humantime_fmt(*age)
        );
        let purge = DeadPurge {
            older_than: *age,
            batch_size: *batch_size,
            by,
            reason: &reason,
            yes: *yes,
        };
        let deleted = purge_dead(&store, &purge).await?;
        out(&serde_json::json!({ "dead_deleted": deleted }).to_string());
        return Ok(ExitCode::SUCCESS);
    }
    let older_than = older_than_s
        .map(Duration::from_secs)
        .or(*older_than)
        .unwrap_or(DEFAULT_RETENTION);
    if !yes {
        let matching = store.count_purgeable(older_than).await?;
        confirm_purge(matching, "dispatched row", older_than)?;
    }
    let mut total = 0u64;
    let mut locked_out = false;
    loop {
        let b = store.purge(older_than, *batch_size).await?;
        if b.locked_out {
            // Not a failure: the other purger does the same work (a cron job that
            // overlaps the previous run must not page anyone).
            eprintln!(
                "another purge is running on this outbox; this one stops, having deleted {}",
                counted(total, "row"),
            );
            locked_out = true;
            break;
        }
        total += b.deleted;
        if b.deleted < u64::from(*batch_size) {
            break;
        }
        if *pause_ms > 0 {
            tokio::time::sleep(Duration::from_millis(*pause_ms)).await;
        }
    }
    out(&serde_json::json!({ "deleted": total, "locked_out": locked_out }).to_string());
    Ok(ExitCode::SUCCESS)
}

/// The retention of dispatched rows when neither --older-than nor --older-than-s is given.
const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The rule of every purge: more than [`CONFIRM_ABOVE`] rows (`matching` rows, each a
/// `noun`, older than `older_than`) are deleted only after a yes on the terminal; without
/// one (or without a terminal) the purge is refused. `--yes` skips it.
pub(crate) fn confirm_purge(matching: u64, noun: &str, older_than: Duration) -> anyhow::Result<()> {
    if matching <= CONFIRM_ABOVE {
        return Ok(());
    }
    let rows = counted(matching, noun);
    let age = humantime_fmt(older_than);
    if confirm(&format!(
        "{rows} are older than {age}; delete them all? [y/N] "
    ))? {
        return Ok(());
    }
    anyhow::bail!(
        "{rows} are older than {age} and --yes was not given: refusing to delete more than {} without it (a scheduled purge passes --yes)",
        counted(CONFIRM_ABOVE, "row")
    )
}

/// A purge of dead rows, as `outbox purge --dead-older-than` asks for it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeadPurge<'a> {
    /// Dead rows that died longer ago than this.
    pub(crate) older_than: Duration,
    /// Rows per delete statement.
    pub(crate) batch_size: u32,
    /// Who (kept in the audit row).
    pub(crate) by: &'a str,
    /// Why (kept in the audit row).
    pub(crate) reason: &'a str,
    /// Delete more than [`CONFIRM_ABOVE`] rows without asking.
    pub(crate) yes: bool,
}

/// Deletes dead rows older than `older_than` in bounded batches, as one audited operation.
pub(crate) async fn purge_dead(store: &dyn Store, purge: &DeadPurge<'_>) -> anyhow::Result<u64> {
    let DeadPurge {
        older_than,
        batch_size,
        by,
        reason,
        yes,
    } = *purge;
    let mut request = ReplayRequest {
        selector: DeadSelector {
            died_before_ago: Some(older_than),
            ..DeadSelector::default()
        },
        action: ReplayAction::Purge,
        limit: Some(batch_size),
        by: by.to_owned(),
        reason: reason.to_owned(),
        rate_per_s: None,
        dry_run: false,
        append_to: None,
    };
    let matching = store.count_dead(&request.selector).await?;
    if matching > CONFIRM_ABOVE
        && !yes
        && !confirm(&format!(
            "{matching} dead rows died longer ago than that; delete them all? [y/N] "
        ))?
    {
        anyhow::bail!(
            "{matching} dead rows match and --yes was not given: refusing to delete them all (`outbox dead list` shows them)"
        );
    }
    let mut total = 0;
    loop {
        let done = store.replay(&request).await?;
        total += done.count;
        request.append_to = request.append_to.or(done.replay_id);
        if done.count < u64::from(batch_size) {
            return Ok(total);
        }
    }
}
