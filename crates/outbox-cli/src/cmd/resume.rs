//! `outbox resume`: let relays publish again (the pause switch, or one topic pause).

use super::pause::{audit, paused_topics};
use crate::shared::{GlobalArgs, open_checked};
use outbox::store::Store;
use std::process::ExitCode;

/// `outbox resume`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// The topic pattern to resume, exactly as paused.
    #[arg(long)]
    topic: Option<String>,
    /// Why (kept in the audit, `outbox replays`; optional).
    #[arg(long, default_value = "")]
    reason: String,
    #[command(flatten)]
    by: super::ByArgs,
}

/// Runs `outbox resume`.
pub(crate) async fn run(global: &GlobalArgs, args: &Args) -> anyhow::Result<ExitCode> {
    let Args { topic, reason, by } = args;
    let by = &by.by;
    let store = open_checked(global).await?;
    eprintln!("{}", resume(&store, topic.as_deref(), reason, by).await?);
    Ok(ExitCode::SUCCESS)
}

/// Lifts the pause switch (`topic` None) or the topic pause of exactly `topic`, recorded
/// in the audit as by `by` because of `reason` (may be empty); what happened, in one line
/// for people. An unknown topic pause is an error naming those in force.
pub(crate) async fn resume(
    store: &dyn Store,
    topic: Option<&str>,
    reason: &str,
    by: &str,
) -> anyhow::Result<String> {
    match topic {
        Some(t) => {
            if !store.resume_topic(t).await? {
                let paused = paused_topics(store).await?;
                anyhow::bail!(
                    "no topic pause {t:?} (paused: {}); resume takes the pattern exactly as paused",
                    if paused.is_empty() {
                        "none".to_owned()
                    } else {
                        paused.join(", ")
                    }
                );
            }
            audit(store, by, reason, "resume", Some(t)).await?;
            Ok(format!("topic pause {t} lifted"))
        }
        None => {
            let was_paused = store.pause_state().await?.paused;
            store.set_pause(None).await?;
            let topics = store.pause_state().await?.topics;
            if !was_paused {
                // Resuming is idempotent: nothing changed, nothing to audit.
                return Ok(if topics.is_empty() {
                    "the outbox was not paused: nothing to resume".into()
                } else {
                    let list: Vec<&str> = topics.iter().map(|p| p.pattern.as_str()).collect();
                    format!(
                        "the outbox was not paused; topic pauses in force: {} (`outbox resume --topic PATTERN` lifts one)",
                        list.join(", ")
                    )
                });
            }
            audit(store, by, reason, "resume", None).await?;
            if topics.is_empty() {
                Ok("outbox resumed".into())
            } else {
                let list: Vec<&str> = topics.iter().map(|p| p.pattern.as_str()).collect();
                Ok(format!(
                    "outbox resumed; topic pauses still in force: {} (`outbox resume --topic PATTERN` lifts one)",
                    list.join(", ")
                ))
            }
        }
    }
}
