//! `outbox replays list`: the audit of replays, discards, dead-row purges, pauses and
//! resumes.

use crate::shared::{GlobalArgs, open_checked, out};
use crate::text::{clip, one_line, safe};
use outbox::store::Store;
use std::process::ExitCode;

/// `outbox replays …`
#[derive(clap::Subcommand, Debug)]
pub(crate) enum ReplaysCommand {
    /// The audit of replays, discards, dead-row purges, pauses and resumes, newest first.
    List {
        /// Most rows.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `outbox replays …`.
pub(crate) async fn run(global: &GlobalArgs, cmd: &ReplaysCommand) -> anyhow::Result<ExitCode> {
    let store = open_checked(global).await?;
    replays(&store, cmd).await
}

async fn replays(store: &dyn Store, cmd: &ReplaysCommand) -> anyhow::Result<ExitCode> {
    let ReplaysCommand::List { limit, json } = cmd;
    let rows = store.replays(*limit).await?;
    if *json {
        for r in &rows {
            out(&serde_json::to_string(r)?);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        eprintln!("no replays, discards or dead-row purges yet");
        return Ok(ExitCode::SUCCESS);
    }
    out(&format!(
        "{:>6}  {:<20}  {:<8}  {:>7}  {:<14}  {:<30}  selection",
        "id", "at", "action", "rows", "by", "reason"
    ));
    for r in rows {
        out(&format!(
            "{:>6}  {:<20}  {:<8}  {:>7}  {:<14}  {:<30}  {}",
            r.id,
            r.at.format("%Y-%m-%d %H:%M:%S"),
            r.action,
            r.count,
            clip(&safe(&r.by), 14),
            clip(&one_line(&r.reason), 30),
            safe(&r.selection)
        ));
    }
    Ok(ExitCode::SUCCESS)
}
