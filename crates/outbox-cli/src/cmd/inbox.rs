//! `outbox inbox purge`: delete old rows of the consumer inbox.

use crate::shared::{GlobalArgs, humantime_fmt, open_checked, out, parse_duration};
use outbox::store::prelude::*;
use std::process::ExitCode;
use std::time::Duration;

/// `outbox inbox …`
#[derive(clap::Subcommand, Debug)]
pub(crate) enum InboxCommand {
    /// Delete inbox rows received longer ago than --older-than (database clock), oldest
    /// first, in bounded batches. Prints `{"deleted":N}`. A message whose row is gone is
    /// fresh again to its consumer, so ages under 1h are refused: brokers redeliver
    /// unacknowledged messages within their ack wait / visibility timeout, and a dedup row
    /// must outlive every redelivery.
    Purge {
        /// Keep rows younger than this (e.g. 7d, 36h); at least 1h.
        #[arg(long, value_parser = parse_inbox_age)]
        older_than: Duration,
        /// Rows per delete statement.
        #[arg(long, default_value_t = 1_000)]
        batch_size: u32,
        /// Pause between batches, in ms (gives consumers room on a busy database).
        #[arg(long, env = "OUTBOX_INBOX_PURGE_PAUSE_MS", default_value_t = 0)]
        pause_ms: u64,
        /// Delete more than 1,000 rows without asking (a prompt on a terminal; a script
        /// without it is refused: a scheduled purge passes --yes).
        #[arg(long)]
        yes: bool,
    },
}

/// Runs `outbox inbox …`.
pub(crate) async fn run(global: &GlobalArgs, cmd: &InboxCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        InboxCommand::Purge {
            older_than,
            batch_size,
            pause_ms,
            yes,
        } => {
            let store = open_checked(global).await?;
            anyhow::ensure!(*batch_size > 0, "--batch-size must be at least 1");
            if !yes {
                let matching = store.count_inbox_purgeable(*older_than).await?;
                super::purge::confirm_purge(matching, "inbox row", *older_than)?;
            }
            let mut total = 0u64;
            loop {
                let n = store.inbox_purge(*older_than, *batch_size).await?;
                total += n;
                if n < u64::from(*batch_size) {
                    break;
                }
                if *pause_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(*pause_ms)).await;
                }
            }
            out(&serde_json::json!({ "deleted": total }).to_string());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// An inbox retention age: a duration of at least [`outbox::inbox::MIN_RETENTION`].
fn parse_inbox_age(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < outbox::inbox::MIN_RETENTION {
        return Err(format!(
            "{s:?} is shorter than the minimum inbox retention of {}: a dedup row must outlive \
             every redelivery of its message (brokers redeliver unacknowledged messages after \
             their ack wait or visibility timeout), or a late duplicate is processed again",
            humantime_fmt(outbox::inbox::MIN_RETENTION)
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn inbox_purge_ages_below_the_redelivery_window_are_refused() {
        use std::time::Duration;
        assert_eq!(super::parse_inbox_age("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(
            super::parse_inbox_age("7d"),
            Ok(Duration::from_secs(7 * 86400))
        );
        for short in ["59m", "30s", "0s"] {
            let Err(e) = super::parse_inbox_age(short) else {
                panic!("{short} was accepted");
            };
            assert!(e.contains("minimum inbox retention of 1h"), "{e}");
        }
        assert!(super::parse_inbox_age("soon").is_err());
    }
}
