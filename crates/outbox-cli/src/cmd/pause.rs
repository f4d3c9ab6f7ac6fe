//! `outbox pause`: stop relays from publishing, every topic or matching topics; and the
//! audit rows pauses and resumes write.

use crate::shared::{GlobalArgs, open_checked};
use anyhow::Context as _;
use outbox::sink::router::TopicPattern;
use outbox::store::Store;
use std::process::ExitCode;

/// `outbox pause`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Why (shown by `status` and in relay logs).
    #[arg(long)]
    reason: String,
    /// Pause only topics matching this pattern (orders.>, *.v1).
    #[arg(long)]
    topic: Option<String>,
    #[command(flatten)]
    by: super::ByArgs,
}

/// Runs `outbox pause`.
pub(crate) async fn run(global: &GlobalArgs, args: &Args) -> anyhow::Result<ExitCode> {
    let Args { reason, topic, by } = args;
    let by = &by.by;
    let store = open_checked(global).await?;
    eprintln!("{}", pause(&store, topic.as_deref(), reason, by).await?);
    Ok(ExitCode::SUCCESS)
}

/// Pauses every topic (`topic` None) or the topics matching `topic`, as `by` for
/// `reason`; what happened, in one line for people.
pub(crate) async fn pause(
    store: &dyn Store,
    topic: Option<&str>,
    reason: &str,
    by: &str,
) -> anyhow::Result<String> {
    anyhow::ensure!(!reason.trim().is_empty(), "--reason must not be empty");
    match topic {
        Some(t) => {
            let pattern = TopicPattern::parse(t).map_err(anyhow::Error::msg)?;
            let before = store.pause_state().await?;
            store.pause_topic(&pattern, reason, by).await?;
            audit(store, by, reason, "pause", Some(t)).await?;
            Ok(match before.topics.iter().find(|p| p.pattern == *t) {
                Some(old) => format!(
                    "topic pause {t} updated (was by {}: {})",
                    old.by.escape_debug(),
                    old.reason.escape_debug()
                ),
                None => format!(
                    "topics matching {t} paused: relays stop publishing them within about 1 s (rows claimed before that are still published); other topics flow"
                ),
            })
        }
        None => {
            store
                .set_pause(Some(&format!("{reason} (by {by})")))
                .await?;
            audit(store, by, reason, "pause", None).await?;
            Ok(
                "outbox paused: relays stop publishing within about 1 s; producers keep writing"
                    .into(),
            )
        }
    }
}

/// Writes a pause or resume into the audit (`outbox replays`, the dashboard's Replays):
/// after the change, so a failed change leaves no row; a failed write is an error saying
/// the change itself was made.
pub(crate) async fn audit(
    store: &dyn Store,
    by: &str,
    reason: &str,
    action: &str,
    topic: Option<&str>,
) -> anyhow::Result<()> {
    let entry = outbox::store::ops::AuditEntry {
        by: by.to_owned(),
        reason: reason.to_owned(),
        action: action.to_owned(),
        selection: match topic {
            Some(t) => format!("topics {t}"),
            None => "all topics".to_owned(),
        },
    };
    store
        .audit(&entry)
        .await
        .with_context(|| format!("the {action} was made, but writing its audit row failed"))
}

/// The patterns of the topic pauses in force, in byte order.
pub(crate) async fn paused_topics(store: &dyn Store) -> anyhow::Result<Vec<String>> {
    Ok(store
        .pause_state()
        .await?
        .topics
        .into_iter()
        .map(|p| p.pattern)
        .collect())
}
