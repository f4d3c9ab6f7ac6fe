//! `outbox replay`: move dead letters back to pending (same message id, attempts
//! reset), audited.

use super::change::{ChangeArgs, change_dead};
use crate::shared::{GlobalArgs, open_checked};
use std::process::ExitCode;

/// `outbox replay`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    #[command(flatten)]
    change: ChangeArgs,
    /// Spread the replayed rows' availability at this many per second (e.g. 50).
    #[arg(long, value_parser = parse_rate)]
    rate: Option<f64>,
}

/// Runs `outbox replay`.
pub(crate) async fn run(global: &GlobalArgs, args: &Args) -> anyhow::Result<ExitCode> {
    let Args { change, rate } = args;
    let store = open_checked(global).await?;
    change_dead(&store, change, outbox::store::ReplayAction::Replay, *rate).await
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let n = s.trim();
    let n = n.strip_suffix("/s").unwrap_or(n);
    match n.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!(
            "rate {s:?} must be a positive number per second, e.g. 50 or 50/s"
        )),
    }
}
