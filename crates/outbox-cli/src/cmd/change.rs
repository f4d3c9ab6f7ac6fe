//! Changes to dead rows, as `outbox replay` and `outbox dead discard` make them (and the
//! dashboard): the checks every change needs, a dry run, a confirmation, the change.
//! Every change goes through `Operations::replay`, which writes the audit row in the same
//! transaction.

use crate::shared::parse_duration;
use crate::shared::{CONFIRM_ABOVE, confirm, out};
use crate::text::counted;
use anyhow::Context as _;
use chrono::{DateTime, Utc};
use outbox::store::{DeadSelector, ReplayAction, ReplayOutcome, ReplayRequest, Store};
use outbox::topic::TopicPattern;
use std::process::ExitCode;
use std::time::Duration;

/// What every change to dead rows needs: which, who, why, and how carefully.
#[derive(clap::Args, Debug)]
pub(crate) struct ChangeArgs {
    #[command(flatten)]
    pub(crate) select: SelectArgs,
    /// Why (kept in the audit row). Required, except with --dry-run.
    #[arg(long, required_unless_present = "dry_run")]
    pub(crate) reason: Option<String>,
    #[command(flatten)]
    pub(crate) by: super::ByArgs,
    /// Print the count and a sample; change nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Most rows to change (in id order).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) limit: Option<u32>,
    /// Change more than 1,000 rows without --limit and without asking.
    #[arg(long)]
    pub(crate) yes: bool,
}

/// What a change to dead rows says about itself, and what its fields are called where
/// it came from (flags or JSON fields), for the refusals.
pub(crate) struct ChangeText<'a> {
    /// Why (kept in the audit row).
    pub(crate) reason: &'a str,
    /// Who (kept in the audit row).
    pub(crate) by: &'a str,
    /// The field names: (selection, reason, by).
    pub(crate) names: (&'a str, &'a str, &'a str),
}

/// The flags' names for [`ChangeText::names`].
pub(crate) const CLI_NAMES: (&str, &str, &str) = (
    "ids, --id-range, --topic, --since or --error",
    "--reason",
    "--by",
);

/// The checks every change to dead rows needs (a selection, a reason, who), and the
/// request as a dry run: the CLI and the dashboard run it, show the count, then run it
/// again with `dry_run` off.
pub(crate) fn change_request(
    selector: DeadSelector,
    action: ReplayAction,
    text: ChangeText<'_>,
    limit: Option<u32>,
    rate_per_s: Option<f64>,
) -> anyhow::Result<ReplayRequest> {
    let (selection, reason, by) = text.names;
    anyhow::ensure!(
        !selector.is_empty(),
        "select the dead rows to {}: {selection} (an empty selection would take every dead row)",
        action.as_str()
    );
    anyhow::ensure!(
        !text.reason.trim().is_empty(),
        "{reason} must not be empty: it is kept in the audit row"
    );
    anyhow::ensure!(
        !text.by.trim().is_empty(),
        "{by} must not be empty: it is kept in the audit row"
    );
    Ok(ReplayRequest {
        selector,
        action,
        limit,
        by: text.by.to_owned(),
        reason: text.reason.to_owned(),
        rate_per_s,
        dry_run: true,
        append_to: None,
    })
}

/// Replays or discards the selected dead rows, after the checks every change needs.
pub(crate) async fn change_dead(
    store: &dyn Store,
    change: &ChangeArgs,
    action: ReplayAction,
    rate_per_s: Option<f64>,
) -> anyhow::Result<ExitCode> {
    let selector = change.select.selector()?;
    let mut request = change_request(
        selector,
        action,
        ChangeText {
            // A dry run writes no audit row: it needs no reason.
            reason: change.reason.as_deref().unwrap_or("dry run"),
            by: &change.by.by,
            names: CLI_NAMES,
        },
        change.limit,
        rate_per_s,
    )?;
    let preview = store.replay(&request).await?;
    report_refused(&preview);
    if change.dry_run {
        out(&format!(
            "dry run: {} would be {}{}",
            counted(preview.count, "dead row"),
            past(action),
            sample_text(&preview)
        ));
        // The exit code the run itself would have: 1 when named rows are refused.
        return Ok(if preview.refused.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    if preview.count == 0 {
        eprintln!("nothing to {}: no dead row matches", action.as_str());
        return Ok(if preview.refused.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    if preview.count > CONFIRM_ABOVE && change.limit.is_none() && !change.yes {
        let ask = format!(
            "{} match; {} them all? [y/N] ",
            counted(preview.count, "dead row"),
            action.as_str()
        );
        if !confirm(&ask)? {
            anyhow::bail!(
                "{} match and neither --limit nor --yes was given: refusing to {} them all (run with --dry-run to see a sample)",
                counted(preview.count, "dead row"),
                action.as_str()
            );
        }
    }
    request.dry_run = false;
    let done = store.replay(&request).await?;
    if done.count == 0 {
        eprintln!(
            "nothing to {}: the matching rows are no longer dead (another replay or discard took them)",
            action.as_str()
        );
        return Ok(ExitCode::FAILURE);
    }
    out(&format!(
        "{} {} (audit id {}){}",
        past(action),
        counted(done.count, "dead row"),
        done.replay_id.map_or("-".into(), |i| i.to_string()),
        match (action, rate_per_s) {
            (ReplayAction::Replay, Some(r)) =>
                format!(", due over {:.0} s at {r}/s", done.count as f64 / r),
            _ => String::new(),
        }
    ));
    Ok(if done.refused.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn past(action: ReplayAction) -> &'static str {
    match action {
        ReplayAction::Replay => "replayed",
        ReplayAction::Discard | ReplayAction::Purge => "discarded",
    }
}

fn sample_text(o: &ReplayOutcome) -> String {
    if o.sample.is_empty() {
        return String::new();
    }
    let ids: Vec<String> = o.sample.iter().map(i64::to_string).collect();
    format!(
        "; ids {}{}",
        ids.join(", "),
        if o.count > o.sample.len() as u64 {
            ", …"
        } else {
            ""
        }
    )
}

fn report_refused(o: &ReplayOutcome) {
    for r in &o.refused {
        eprintln!("refused {}: {}", r.what, r.reason);
    }
}

/// How dead rows are chosen (every option given must hold).
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct SelectArgs {
    /// Row ids (the `id` column) or message ids (UUIDs); comma-separated or repeated.
    #[arg(value_delimiter = ',')]
    pub(crate) ids: Vec<String>,
    /// Rows whose id is in A..B (inclusive), e.g. 100..250.
    #[arg(long)]
    pub(crate) id_range: Option<String>,
    /// Topic pattern: dotted, `*` one token, `>` (last) one or more (orders.>).
    #[arg(long)]
    pub(crate) topic: Option<String>,
    /// Died within this long (90s, 15m, 2h, 7d) or at/after this RFC 3339 time.
    #[arg(long)]
    pub(crate) since: Option<String>,
    /// Last error contains this text (case-insensitive).
    #[arg(long)]
    pub(crate) error: Option<String>,
}

impl SelectArgs {
    pub(crate) fn selector(&self) -> anyhow::Result<DeadSelector> {
        let mut sel = DeadSelector::default();
        for id in &self.ids {
            let id = id.trim();
            if id.is_empty() {
                continue;
            }
            if let Ok(n) = id.parse::<i64>() {
                sel.ids.push(n);
            } else {
                sel.message_ids
                    .push(uuid::Uuid::parse_str(id).with_context(|| {
                        format!("{id:?} is neither a row id (an integer) nor a message id (a UUID)")
                    })?);
            }
        }
        if let Some(r) = &self.id_range {
            let (a, b) = r
                .split_once("..")
                .with_context(|| format!("--id-range {r:?} must be A..B"))?;
            let a: i64 = a
                .trim()
                .parse()
                .context("--id-range: A must be an integer")?;
            let b: i64 = b
                .trim()
                .trim_start_matches('=')
                .parse()
                .context("--id-range: B must be an integer")?;
            anyhow::ensure!(a <= b, "--id-range {r:?}: A must not exceed B");
            sel.id_range = Some((a, b));
        }
        if let Some(t) = &self.topic {
            sel.topic = Some(TopicPattern::parse(t).map_err(anyhow::Error::msg)?);
        }
        if let Some(s) = &self.since {
            match parse_duration(s) {
                Ok(d) => {
                    anyhow::ensure!(
                        d <= MAX_SINCE,
                        "--since {s:?} reaches back too far: give at most 100y (a duration) or an RFC 3339 time"
                    );
                    sel.died_within = Some(d);
                }
                Err(_) => {
                    let t = DateTime::parse_from_rfc3339(s).with_context(|| {
                        format!(
                            "--since {s:?} is neither a duration (a number and a unit: 90s, 15m, 2h, 7d) nor an RFC 3339 time (2026-12-01T10:00:00Z)"
                        )
                    })?;
                    sel.died_after = Some(t.with_timezone(&Utc));
                }
            }
        }
        if let Some(e) = &self.error {
            anyhow::ensure!(!e.trim().is_empty(), "--error must not be empty");
            sel.error_contains = Some(e.clone());
        }
        Ok(sel)
    }
}

/// The longest `--since` duration: 100 years (older times are given as RFC 3339 times).
const MAX_SINCE: Duration = Duration::from_secs(100 * 31_557_600);
