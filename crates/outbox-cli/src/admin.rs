//! The operator's commands: `status` (with relays and a verdict), `dead list|show|discard`,
//! `replay`, `replays list`, topic pauses and dead-row retention. Every change to dead
//! rows goes through `Operations::replay`, which writes the audit row in the same transaction.

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use outbox::sink::router::TopicPattern;
use outbox::store::{
    DeadLetter, DeadSelector, Overview, PauseState, RELAY_EXPIRY, RelayRecord, ReplayAction,
    ReplayOutcome, ReplayRequest, Store,
};
use std::process::ExitCode;
use std::time::Duration;

use crate::out;

/// More rows than this need `--limit` or `--yes` (a prompt on a terminal).
pub(crate) const CONFIRM_ABOVE: u64 = 1_000;

/// How dead rows are chosen (every option given must hold).
#[derive(Args, Debug, Clone, Default)]
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

/// A duration like `90s`, `15m`, `2h`, `7d` (humantime syntax, `1h30m` too).
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("{s:?} is not a duration: {e}"))
}

/// The verdict's limits, as `status` and `serve` take them.
#[derive(Args, Debug, Clone)]
pub(crate) struct LimitsArgs {
    /// BEHIND when a message has been due this long without being delivered (60s, 15m,
    /// 2h); a delayed message or a retry counts from when it became due.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    max_age: Duration,
    /// DEAD when there are more dead letters than this.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    max_dead: i64,
    /// STUCK when rows have been due this long and no live relay claimed within it.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    stuck_after: Duration,
}

impl LimitsArgs {
    /// The limits these flags give.
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            max_age: self.max_age,
            max_dead: self.max_dead,
            stuck_after: self.stuck_after,
        }
    }
}

/// Per-key ordering, as `relay`, `status` and `dead list` take it (one setting, the
/// same `OUTBOX_ORDERED` for all three).
#[derive(Args, Debug, Clone)]
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

/// `outbox dead …`
#[derive(Subcommand, Debug)]
pub(crate) enum DeadCommand {
    /// List dead letters: id, message id, topic, key, attempts, died at, the later messages
    /// of its key still waiting, last error. A dead letter of an ordered topic with a key
    /// is marked BLOCKS: its key's later messages wait until it is replayed or discarded.
    List {
        #[command(flatten)]
        select: SelectArgs,
        // With --ordered, which dead letters block their key.
        #[command(flatten)]
        ordering: OrderingArgs,
        /// Most rows to show.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter: the envelope, every header, the full error, timestamps.
    Show {
        /// Row id or message id.
        id: String,
        /// Also print the payload (UTF-8 text as is, anything else as hex).
        #[arg(long)]
        payload: bool,
        /// One JSON object (payload base64-encoded when asked for).
        #[arg(long)]
        json: bool,
    },
    /// Delete dead letters for good (audited in `outbox replays list`).
    Discard {
        #[command(flatten)]
        change: ChangeArgs,
    },
}

/// What every change to dead rows needs: which, who, why, and how carefully.
#[derive(Args, Debug)]
pub(crate) struct ChangeArgs {
    #[command(flatten)]
    pub(crate) select: SelectArgs,
    /// Why (kept in the audit row). Required, except with --dry-run.
    #[arg(long, required_unless_present = "dry_run")]
    pub(crate) reason: Option<String>,
    /// Who (kept in the audit row). Required, except with --dry-run.
    #[arg(long, required_unless_present = "dry_run")]
    pub(crate) by: Option<String>,
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

/// `outbox replays …`
#[derive(Subcommand, Debug)]
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

pub(crate) async fn dead(store: &dyn Store, cmd: &DeadCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        DeadCommand::List {
            select,
            ordering,
            limit,
            json,
        } => {
            let sel = select.selector()?;
            let rows = store.dead_letters(&sel, *limit, false).await?;
            let ordering = ordering.ordering();
            let blocks = |r: &DeadLetter| blocks_its_key(r, &ordering);
            if *json {
                for r in &rows {
                    out(&dead_letter_json(r, &ordering)?.to_string());
                }
                return Ok(ExitCode::SUCCESS);
            }
            if rows.is_empty() {
                eprintln!(
                    "no dead letters{}",
                    if sel.is_empty() { "" } else { " match" }
                );
                return Ok(ExitCode::SUCCESS);
            }
            out(&format!(
                "{:>8}  {:<36}  {:<28}  {:<12}  {:>4}  {:<20}  {:>6}  {:<6}  last error",
                "id", "message id", "topic", "key", "att", "died at", "behind", "order"
            ));
            for r in &rows {
                out(&format!(
                    "{:>8}  {:<36}  {:<28}  {:<12}  {:>4}  {:<20}  {:>6}  {:<6}  {}",
                    r.id,
                    r.message_id,
                    clip(&safe(&r.topic), 28),
                    clip(&safe(r.key.as_deref().unwrap_or("-")), 12),
                    r.attempts,
                    r.died_at.format("%Y-%m-%d %H:%M:%S"),
                    r.waiting_behind,
                    if blocks(r) { "BLOCKS" } else { "" },
                    clip(&one_line(r.last_error.as_deref().unwrap_or("")), 100),
                ));
            }
            let blocking = rows.iter().filter(|r| blocks(r)).count();
            if blocking > 0 {
                // Per key, the rows behind its first dead letter listed (the later dead
                // letters of the key count the same rows again).
                let mut per_key: std::collections::HashMap<(&str, Option<&str>), i64> =
                    std::collections::HashMap::new();
                for r in rows.iter().filter(|r| blocks(r)) {
                    let n = per_key.entry((&r.topic, r.key.as_deref())).or_default();
                    *n = (*n).max(r.waiting_behind);
                }
                let held: i64 = per_key.values().sum();
                eprintln!(
                    "{} {} ({} {}): `outbox replay` delivers one first, then the rest of its key; `outbox dead discard` releases the rest",
                    counted(blocking as i64, "dead letter"),
                    if blocking == 1 {
                        "blocks its key"
                    } else {
                        "block their keys"
                    },
                    counted(held, "later message"),
                    if held == 1 { "waits" } else { "wait" },
                );
            }
            let total = store.count_dead(&sel).await?;
            if total > rows.len() as u64 {
                eprintln!(
                    "{} of {} shown (--limit to see more)",
                    group(rows.len() as i64),
                    group(total as i64)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        DeadCommand::Show { id, payload, json } => {
            let Some(r) = find_dead_letter(store, id, *payload).await? else {
                anyhow::bail!(
                    "no dead letter with id or message id {id} (a row that is pending, claimed or dispatched is not a dead letter)"
                );
            };
            if *json {
                let mut v = serde_json::to_value(&r)?;
                if let (true, Some(p)) = (*payload, &r.payload) {
                    use base64::Engine as _;
                    v["payload_base64"] =
                        base64::engine::general_purpose::STANDARD.encode(p).into();
                }
                out(&v.to_string());
                return Ok(ExitCode::SUCCESS);
            }
            out(&show_text(&r, *payload));
            Ok(ExitCode::SUCCESS)
        }
        DeadCommand::Discard { change } => {
            change_dead(store, change, ReplayAction::Discard, None).await
        }
    }
}

/// True when `r` holds back the later messages of its key (its topic is ordered, it has
/// a key, and dead letters are not skipped).
pub(crate) fn blocks_its_key(r: &DeadLetter, ordering: &outbox::store::KeyOrdering) -> bool {
    !ordering.skip_dead && r.key.is_some() && ordering.covers(&r.topic)
}

/// A dead letter as `dead list --json` prints it and the dashboard's API returns it: its
/// fields and `blocking`.
pub(crate) fn dead_letter_json(
    r: &DeadLetter,
    ordering: &outbox::store::KeyOrdering,
) -> anyhow::Result<serde_json::Value> {
    let mut v = serde_json::to_value(r)?;
    v["blocking"] = blocks_its_key(r, ordering).into();
    Ok(v)
}

/// The dead letter with row id or message id `id` (with its payload when asked);
/// `None` when no dead row has it.
///
/// # Errors
/// `id` is neither an integer nor a UUID; the store fails.
pub(crate) async fn find_dead_letter(
    store: &dyn Store,
    id: &str,
    payload: bool,
) -> anyhow::Result<Option<DeadLetter>> {
    let sel = SelectArgs {
        ids: vec![id.to_owned()],
        ..SelectArgs::default()
    }
    .selector()?;
    anyhow::ensure!(!sel.is_empty(), "give a row id or a message id");
    Ok(store.dead_letters(&sel, 1, payload).await?.pop())
}

fn show_text(r: &DeadLetter, with_payload: bool) -> String {
    let mut t = String::new();
    let mut line = |k: &str, v: String| t.push_str(&format!("{k:<13} {v}\n"));
    line("id", r.id.to_string());
    line("message id", r.message_id.to_string());
    line("topic", safe(&r.topic));
    line("key", safe(r.key.as_deref().unwrap_or("-")));
    if r.key.is_some() {
        line(
            "behind it",
            format!(
                "{} of this topic and key not delivered yet ({} for this one where the topic is ordered)",
                counted(r.waiting_behind, "later message"),
                if r.waiting_behind == 1 {
                    "it waits"
                } else {
                    "they wait"
                }
            ),
        );
    }
    line("attempts", r.attempts.to_string());
    line("occurred at", r.occurred_at.to_rfc3339());
    line("died at", r.died_at.to_rfc3339());
    if let Some(id) = r.replay_id {
        line("replayed by", format!("replay {id} (and died again)"));
    }
    line("payload", counted(r.payload_bytes, "byte"));
    match serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&r.headers) {
        Ok(map) if map.is_empty() => line("headers", "(none)".into()),
        Ok(map) => {
            line("headers", String::new());
            for (k, v) in map {
                match v.as_str() {
                    Some(v) => t.push_str(&format!("  {}: {}\n", safe(&k), safe(v))),
                    None => t.push_str(&format!(
                        "  {}: {}   (not a string: the relay cannot publish this header)\n",
                        safe(&k),
                        safe(&v.to_string())
                    )),
                }
            }
        }
        Err(_) => line(
            "headers",
            format!("(not a JSON object) {}", safe(&r.headers)),
        ),
    }
    t.push_str(&format!(
        "last error\n  {}\n",
        safe(r.last_error.as_deref().unwrap_or("(none)")).replace('\n', "\n  ")
    ));
    if with_payload && let Some(bytes) = r.payload.as_deref() {
        match payload_view(bytes) {
            PayloadView::Text(text) => {
                t.push_str(&format!("payload (UTF-8)\n{}\n", safe_multiline(text)));
            }
            PayloadView::Hex(lines) => {
                t.push_str("payload (binary, hex)\n");
                for line in lines {
                    t.push_str(&format!("  {line}\n"));
                }
            }
        }
    } else {
        t.push_str("(payload not shown: --payload prints it)\n");
    }
    t.trim_end().to_owned()
}

/// A payload as people read it: UTF-8 text as is, anything else as lines of hex.
pub(crate) enum PayloadView<'a> {
    /// Valid UTF-8.
    Text(&'a str),
    /// Not UTF-8: 32 bytes a line, as two-digit hex separated by spaces.
    Hex(Vec<String>),
}

/// How `dead show --payload` and the dashboard show a payload.
pub(crate) fn payload_view(bytes: &[u8]) -> PayloadView<'_> {
    match std::str::from_utf8(bytes) {
        Ok(text) => PayloadView::Text(text),
        Err(_) => PayloadView::Hex(
            bytes
                .chunks(32)
                .map(|chunk| {
                    chunk
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect(),
        ),
    }
}

/// Text safe for a terminal: control characters escaped (never raw escape sequences).
fn safe(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

/// As [`safe`], keeping newlines and tabs.
fn safe_multiline(s: &str) -> String {
    s.split('\n')
        .map(|l| safe(&l.replace('\t', "    ")))
        .collect::<Vec<_>>()
        .join("\n")
}

fn one_line(s: &str) -> String {
    safe(&s.replace(['\n', '\r'], " "))
}

fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
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
            // A dry run writes no audit row: it needs neither.
            reason: change.reason.as_deref().unwrap_or("dry run"),
            by: change.by.as_deref().unwrap_or("dry run"),
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
            counted(preview.count as i64, "dead row"),
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
            counted(preview.count as i64, "dead row"),
            action.as_str()
        );
        if !confirm(&ask)? {
            anyhow::bail!(
                "{} match and neither --limit nor --yes was given: refusing to {} them all (run with --dry-run to see a sample)",
                counted(preview.count as i64, "dead row"),
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
        counted(done.count as i64, "dead row"),
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

/// Asks on the terminal; false without one (a script must say --yes or --limit).
fn confirm(question: &str) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        return Ok(false);
    }
    eprint!("{question}");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

pub(crate) async fn replays(store: &dyn Store, cmd: &ReplaysCommand) -> anyhow::Result<ExitCode> {
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

/// Deletes dead rows older than `older_than` in bounded batches, as one audited operation.
pub(crate) async fn purge_dead(
    store: &dyn Store,
    older_than: Duration,
    batch_size: u32,
    by: &str,
    reason: &str,
    yes: bool,
) -> anyhow::Result<u64> {
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
async fn audit(
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

/// The verdict `status` prints and `status --check` exits on.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Verdict {
    /// In the order they are checked: `STUCK`, `PAUSED`, `BLOCKED`, `BEHIND`, `DEAD`, `OK`.
    pub(crate) state: &'static str,
    /// One line for people.
    pub(crate) text: String,
}

/// Thresholds of the verdict.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// A row due for longer than this is BEHIND.
    pub(crate) max_age: Duration,
    /// More dead rows than this is DEAD.
    pub(crate) max_dead: i64,
    /// Rows due this long with no relay claiming is STUCK.
    pub(crate) stuck_after: Duration,
}

impl Default for Limits {
    /// `outbox status`'s defaults: 60 s, no dead letters, 30 s.
    fn default() -> Self {
        Limits {
            max_age: Duration::from_secs(60),
            max_dead: 0,
            stuck_after: Duration::from_secs(30),
        }
    }
}

/// Decides the verdict from the overview, the live relays, the pause switch and what
/// per-key ordering holds behind dead letters (`held`; zero without `--ordered`), in the
/// order an operator acts on: stuck (nothing moves), paused, blocked (ordered keys behind
/// dead letters), behind, dead letters. `due_held` ([`Views::due_held_by_order`](outbox::store::Views::due_held_by_order), read
/// with `--ordered` while rows are due) says which due rows per-key ordering holds back
/// (behind dead letters, or behind a first row of their key that is not due yet): only
/// the others count as stuck or behind. Without it, no due row is held.
pub(crate) fn verdict(
    o: &Overview,
    relays: &[RelayRecord],
    pause: &PauseState,
    held: &outbox::store::HeldKeys,
    due_held: Option<&outbox::store::DueHeld>,
    limits: &Limits,
) -> Verdict {
    let stuck_s = secs(limits.stuck_after);
    let claiming = relays
        .iter()
        .any(|r| last_claim_ago_s(r).is_some_and(|s| s <= stuck_s as f64));
    // Rows held by per-key ordering wait by design: they are not stuck.
    let due_free = o.due - due_held.map_or(0, |d| d.held);
    // How long the oldest due row that nothing holds has been due.
    let free_due_s = due_held.map_or(o.oldest_due_s, |d| d.oldest_free_due_s);
    if let Some(due_s) = free_due_s
        && due_free > 0
        && due_s >= stuck_s
        && !claiming
        && !pause.paused
        // Live relays and topic pauses: the due rows may be the paused topics' (below).
        && (pause.topics.is_empty() || relays.is_empty())
    {
        let who = if relays.is_empty() {
            "no relay is alive".to_owned()
        } else if relays.len() == 1 {
            "the only live relay has not claimed".to_owned()
        } else {
            format!("none of the {} live relays has claimed", relays.len())
        };
        return Verdict {
            state: "STUCK",
            text: format!(
                "{} due for {due_s} s and {who}",
                counted(due_free, "message")
            ),
        };
    }
    if let Some(due_s) = free_due_s
        && due_free > 0
        && due_s >= stuck_s
        && !pause.topics.is_empty()
        && !claiming
    {
        let list: Vec<&str> = pause.topics.iter().map(|p| p.pattern.as_str()).collect();
        return Verdict {
            state: "PAUSED",
            text: format!(
                "{} due for {due_s} s while topic pauses are in force ({}): the paused topics' rows wait; `outbox resume --topic PATTERN` lifts one",
                counted(due_free, "message"),
                list.join(", ")
            ),
        };
    }
    if pause.paused {
        return Verdict {
            state: "PAUSED",
            text: format!(
                "relays are not publishing ({}); `outbox resume` lifts it",
                pause.reason.as_deref().unwrap_or("no reason given")
            ),
        };
    }
    if held.held == 0 && o.parked > 0 {
        // Seen without the relays' --ordered patterns: the parked rows say it.
        return Verdict {
            state: "BLOCKED",
            text: format!(
                "{} parked behind dead letters of their keys (per-key ordering): `outbox dead list --ordered PATTERN` marks the blocking ones; `outbox replay` delivers one first, `outbox dead discard` releases the rest",
                if o.parked == 1 {
                    "1 message is".to_owned()
                } else {
                    format!("{} messages are", group(o.parked))
                }
            ),
        };
    }
    if held.held > 0 {
        return Verdict {
            state: "BLOCKED",
            text: format!(
                "{} of {} {} behind dead letters (oldest {}): `outbox dead list --ordered …` marks them BLOCKS; `outbox replay` delivers one first, `outbox dead discard` releases the rest",
                counted(held.held, "message"),
                counted(held.blocked_keys, "ordered key"),
                if held.held == 1 { "waits" } else { "wait" },
                human(held.oldest_held_age_seconds.unwrap_or(0))
            ),
        };
    }
    // Behind: a row due and not taken for longer than the limit. Rows not due yet (a
    // delayed message, a retry's backoff) are not late, however old.
    if let Some(age) = free_due_s
        && age > secs(limits.max_age)
    {
        return Verdict {
            state: "BEHIND",
            text: format!(
                "the oldest due message has waited {} (limit {})",
                human(age),
                human(secs(limits.max_age))
            ),
        };
    }
    if o.counts.dead > limits.max_dead {
        return Verdict {
            state: "DEAD",
            text: format!(
                "{} (limit {}): `outbox dead list` shows them, `outbox replay` puts them back",
                counted(o.counts.dead, "dead letter"),
                limits.max_dead
            ),
        };
    }
    Verdict {
        state: "OK",
        text: match pause.topics.len() {
            0 => "OK".into(),
            n => format!(
                "OK ({n} topic pause{} in force: their rows wait)",
                if n == 1 { "" } else { "s" }
            ),
        },
    }
}

/// Seconds since the relay's last claim that returned rows, on the database clock alone
/// (the time since its last heartbeat plus how long before that heartbeat it claimed).
fn last_claim_ago_s(r: &RelayRecord) -> Option<f64> {
    let at = r.last_claim_at?;
    let before_beat = (r.last_seen - at).num_milliseconds().max(0) as f64 / 1000.0;
    Some(r.last_seen_ago_s + before_beat)
}

/// 1204 → "1,204".
/// Whole seconds of `d`, as the database's ages are counted (a duration past i64's range
/// is the largest).
fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

/// `n` (grouped, as [`group`]) and `noun`, plural unless `n` is 1: "1 message",
/// "1,204 messages".
pub(crate) fn counted(n: i64, noun: &str) -> String {
    format!("{} {noun}{}", group(n), if n == 1 { "" } else { "s" })
}

pub(crate) fn group(n: i64) -> String {
    let s = n.abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// Seconds as "95 s", "14 min", "3.2 h", "2.0 d".
fn human(s: i64) -> String {
    match s {
        s if s < 120 => format!("{s} s"),
        s if s < 7_200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{:.1} h", s as f64 / 3600.0),
        s => format!("{:.1} d", s as f64 / 86_400.0),
    }
}

/// Everything `outbox status` and the dashboard's overview read, and the verdict on it.
pub(crate) struct StatusReport {
    /// The store's overview.
    pub(crate) overview: Overview,
    /// The pause switch and topic pauses.
    pub(crate) pause: PauseState,
    /// Live relays.
    pub(crate) relays: Vec<RelayRecord>,
    /// What per-key ordering holds behind dead letters.
    pub(crate) held: outbox::store::HeldKeys,
    /// What per-key ordering holds back of the due rows; read with `--ordered` when rows
    /// are due.
    pub(crate) due_held: Option<outbox::store::DueHeld>,
    /// The verdict.
    pub(crate) verdict: Verdict,
    /// What on the database server holds back the cleanup of dead row versions
    /// ([`Views::cleanup_horizon`](outbox::store::Views::cleanup_horizon)): `None` where the store cannot tell (SQLite), the
    /// error text where reading it failed (a missing privilege: status goes on).
    pub(crate) horizon: Option<Result<outbox::store::CleanupHorizon, String>>,
}

/// An open transaction this old holds back cleanup long enough for claims to slow down
/// measurably on a busy outbox: `status` says so beside its line (the alert
/// OutboxCleanupHeldBack fires at 300 s).
pub(crate) const HORIZON_WARN: Duration = Duration::from_secs(60);

/// The `status` line for what holds back the cleanup, or `None` where the store cannot
/// tell.
pub(crate) fn horizon_line(
    horizon: Option<&Result<outbox::store::CleanupHorizon, String>>,
) -> Option<String> {
    let h = match horizon? {
        Ok(h) => h,
        Err(e) => {
            return Some(format!(
                "oldest transaction  unknown ({}): the server's transaction views are not readable",
                safe(e)
            ));
        }
    };
    let mut line = match &h.oldest {
        None => "oldest transaction  none open in another session".to_owned(),
        Some(t) => {
            let mut who = Vec::new();
            if let Some(pid) = t.pid {
                who.push(format!("pid {pid}"));
            }
            if let Some(u) = &t.user {
                who.push(format!("user {}", safe(u)));
            }
            if let Some(a) = &t.application {
                who.push(format!("application {}", safe(a)));
            }
            if let Some(st) = &t.state {
                who.push(safe(st));
            }
            if let Some(g) = &t.gid {
                who.push(format!("prepared transaction {}", safe(g)));
            }
            let mut l = format!(
                "oldest transaction  {} ({})",
                human(t.age_s as i64),
                who.join(", ")
            );
            if t.age_s >= HORIZON_WARN.as_secs_f64() {
                l.push_str(": holds back cleanup; claims slow down until it ends");
            }
            l
        }
    };
    if let Some(x) = h.xmin_age {
        line.push_str(&format!("; xmin age {} transactions", group(x)));
    }
    if let Some((slot, age)) = &h.slot {
        line.push_str(&format!(
            "\nreplication slot    {} holds xmin {} transactions back",
            safe(slot),
            group(*age)
        ));
    }
    if let Some(n) = h.history_length {
        line.push_str(&format!("; history list length {}", group(n)));
    }
    Some(line)
}

impl StatusReport {
    /// Reads the store (the top `top` topics of pending and dead rows) and decides the
    /// verdict; `ordering` as the relays run (for what waits behind dead letters).
    pub(crate) async fn read(
        store: &dyn Store,
        top: u32,
        limits: &Limits,
        ordering: &outbox::store::KeyOrdering,
    ) -> anyhow::Result<Self> {
        let overview = store.overview(top).await?;
        let pause = store.pause_state().await?;
        let relays = store.relays(RELAY_EXPIRY).await?;
        let held = if ordering.holds_dead() {
            store.held_keys(ordering).await?
        } else {
            outbox::store::HeldKeys::default()
        };
        // Due rows may be held behind their keys' first rows (a delayed message, a retry's
        // backoff), neither stuck nor late.
        let due_held = if ordering.is_on() && overview.due > 0 {
            Some(store.due_held_by_order(ordering).await?)
        } else {
            None
        };
        let verdict = verdict(&overview, &relays, &pause, &held, due_held.as_ref(), limits);
        let horizon = match store.kind() {
            "postgres" | "mysql" => {
                Some(store.cleanup_horizon().await.map_err(|e| format!("{e:#}")))
            }
            _ => None,
        };
        Ok(StatusReport {
            horizon,
            overview,
            pause,
            relays,
            held,
            due_held,
            verdict,
        })
    }

    /// Relay ids that more than one live relay instance runs under (two processes, or two
    /// relays of one program, started under one `--relay-id`), each once, in order.
    pub(crate) fn id_conflicts(&self) -> Vec<&str> {
        let mut ids: Vec<&str> = Vec::new();
        for r in &self.relays {
            let n = self
                .relays
                .iter()
                .filter(|o| o.relay_id == r.relay_id)
                .count();
            if n > 1 && !ids.contains(&r.relay_id.as_str()) {
                ids.push(&r.relay_id);
            }
        }
        ids
    }

    /// Rows claimed by one live relay instance (its own claims, not an earlier process's
    /// of the same id).
    pub(crate) fn claims_of(&self, r: &RelayRecord) -> i64 {
        self.overview
            .claims_by
            .iter()
            .filter(|c| c.relay_id == r.relay_id && c.instance.as_deref() == Some(&r.instance))
            .map(|c| c.claimed)
            .sum()
    }

    /// Claims under the id of a live relay that none of its live instances made: an
    /// earlier process of that id (killed without releasing them) made them; they come
    /// back when their lease ends.
    pub(crate) fn earlier(&self) -> Vec<&outbox::store::ClaimsBy> {
        let live = |id: &str| self.relays.iter().any(|r| r.relay_id == id);
        self.overview
            .claims_by
            .iter()
            .filter(|c| c.instance.is_none() && live(&c.relay_id))
            .collect()
    }

    /// The live relays as `status --json` lists them: each registry row (one per relay
    /// instance) with its own claims (`claimed`) and whether another live instance runs
    /// under its id (`id_conflict`).
    fn relays_json(&self) -> anyhow::Result<serde_json::Value> {
        let conflicts = self.id_conflicts();
        let mut list = Vec::new();
        for r in &self.relays {
            let mut j = serde_json::to_value(r)?;
            j["claimed"] = self.claims_of(r).into();
            j["id_conflict"] = conflicts.contains(&r.relay_id.as_str()).into();
            list.push(j);
        }
        Ok(serde_json::Value::Array(list))
    }

    /// Claims held by relays that are not alive.
    pub(crate) fn orphaned(&self) -> Vec<&outbox::store::ClaimsBy> {
        let live = |id: &str| self.relays.iter().any(|r| r.relay_id == id);
        self.overview
            .claims_by
            .iter()
            .filter(|c| !live(&c.relay_id))
            .collect()
    }

    /// The report as `outbox status --json` prints it (and the dashboard's API returns
    /// it); with the topics when `by_topic`.
    pub(crate) fn to_json(&self, by_topic: bool) -> anyhow::Result<serde_json::Value> {
        let (o, pause, held) = (&self.overview, &self.pause, &self.held);
        let c = &o.counts;
        let mut j = serde_json::json!({
            "pending": c.pending,
            "claimed": c.claimed,
            "dispatched": c.dispatched,
            "dead": c.dead,
            "oldest_pending_age_seconds": c.oldest_pending_age_seconds,
            "paused": pause.paused,
            "pause_reason": pause.reason,
            "due": o.due,
            "oldest_due_seconds": o.oldest_due_s,
            "expired_claims": o.expired_claims,
            "parked": o.parked,
            "relays": self.relays_json()?,
            "relay_id_conflicts": self.id_conflicts(),
            "claims_by": o.claims_by,
            "claims_of_gone_relays": self.orphaned(),
            "claims_of_earlier_processes": self.earlier(),
            "topic_pauses": pause.topics,
            "ordered_blocked_keys": held.blocked_keys,
            "ordered_held": held.held,
            "ordered_due_held": self.due_held.as_ref().map(|d| d.held),
            "verdict": self.verdict,
        });
        match &self.horizon {
            Some(Ok(h)) => j["cleanup_horizon"] = serde_json::to_value(h)?,
            Some(Err(e)) => j["cleanup_horizon_error"] = serde_json::Value::from(e.as_str()),
            None => {}
        }
        if by_topic {
            j["pending_by_topic"] = serde_json::to_value(&o.pending_by_topic)?;
            j["dead_by_topic"] = serde_json::to_value(&o.dead_by_topic)?;
        }
        Ok(j)
    }
}

/// `outbox status`; `ordering` as the relays run (for what waits behind dead letters).
pub(crate) async fn status(
    store: &dyn Store,
    json: bool,
    by_topic: bool,
    check: bool,
    limits: Limits,
    ordering: &outbox::store::KeyOrdering,
) -> anyhow::Result<ExitCode> {
    let top = if by_topic { 10 } else { 0 };
    let report = StatusReport::read(store, top, &limits, ordering).await?;
    let orphaned = report.orphaned();
    let (o, pause, relays, v) = (
        &report.overview,
        &report.pause,
        &report.relays,
        &report.verdict,
    );
    if json {
        out(&report.to_json(by_topic)?.to_string());
    } else {
        let c = &o.counts;
        let age = c
            .oldest_pending_age_seconds
            .map_or("-".to_owned(), |s| format!("{s} s"));
        let mut t = format!(
            "pending     {}\nclaimed     {}\ndispatched  {}\ndead        {}\noldest pending age  {age}\ndue now     {}{}\nexpired claims      {}",
            c.pending,
            c.claimed,
            c.dispatched,
            c.dead,
            o.due,
            o.oldest_due_s
                .map_or(String::new(), |s| format!(" (oldest due for {s} s)")),
            o.expired_claims
        );
        if let Some(d) = report.due_held.as_ref().filter(|d| d.held > 0) {
            t.push_str(&format!(
                "\nheld by order       {} of the due rows {} behind an earlier row of {} key (dead, or not due yet)",
                group(d.held),
                if d.held == 1 { "waits" } else { "wait" },
                if d.held == 1 { "its" } else { "their" }
            ));
        }
        t.push_str(&format!("\nrelays      {} alive", relays.len()));
        for r in relays {
            let claim = last_claim_ago_s(r).map_or("never claimed".to_owned(), |s| {
                format!("last claim {} ago", human(s as i64))
            });
            t.push_str(&format!(
                "\n  {}  {} pid {}  started {}  v{}  {}  in flight {}  claims {}  seen {:.1} s ago  {claim}",
                safe(&r.relay_id),
                safe(&r.host),
                r.pid,
                r.started_at.format("%Y-%m-%d %H:%M:%S"),
                safe(&r.version),
                safe(&r.sink),
                r.in_flight,
                report.claims_of(r),
                r.last_seen_ago_s
            ));
        }
        for id in report.id_conflicts() {
            t.push_str(&format!(
                "\nRELAY ID CONFLICT: {} relays run under {} (listed above): their claims cannot be told apart by claimed_by; give each its own --relay-id",
                relays.iter().filter(|r| r.relay_id == id).count(),
                safe(id)
            ));
        }
        for c in report.earlier() {
            t.push_str(&format!(
                "\nclaimed by an earlier process of {}: {}, {} with an ended lease (the others come back when their lease ends)",
                safe(&c.relay_id),
                counted(c.claimed, "row"),
                c.expired
            ));
        }
        if let Some(line) = horizon_line(report.horizon.as_ref()) {
            t.push('\n');
            t.push_str(&line);
        }
        for c in &orphaned {
            t.push_str(&format!(
                "\nclaimed by {} (not alive): {}, {} with an ended lease (any relay claims those again)",
                safe(&c.relay_id),
                counted(c.claimed, "row"),
                c.expired
            ));
        }
        if pause.paused {
            t.push_str(&format!(
                "\nPAUSED: {}",
                pause.reason.as_deref().unwrap_or("(no reason given)")
            ));
        }
        for p in &pause.topics {
            t.push_str(&format!(
                "\ntopic paused: {}  by {} at {}: {}",
                safe(&p.pattern),
                safe(&p.by),
                p.paused_at.format("%Y-%m-%d %H:%M:%S"),
                safe(&p.reason)
            ));
        }
        if by_topic {
            for (label, rows) in [("pending", &o.pending_by_topic), ("dead", &o.dead_by_topic)] {
                t.push_str(&format!("\n{label} by topic"));
                if rows.is_empty() {
                    t.push_str("  (none)");
                }
                for (topic, n) in rows.iter() {
                    t.push_str(&format!("\n  {n:>10}  {}", safe(topic)));
                }
                let total = if label == "pending" {
                    o.counts.pending
                } else {
                    o.counts.dead
                };
                let shown: i64 = rows.iter().map(|r| r.1).sum();
                if total > shown {
                    t.push_str(&format!("\n  {:>10}  (other topics)", total - shown));
                }
            }
        }
        t.push_str(&format!(
            "\nverdict     {}",
            if v.state == "OK" {
                v.text.clone()
            } else {
                format!("{}: {}", v.state, v.text)
            }
        ));
        out(&t);
    }
    Ok(if check && v.state != "OK" {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox::Counts;

    fn overview(due: i64, oldest_due: Option<i64>, age: Option<i64>, dead: i64) -> Overview {
        Overview {
            counts: Counts {
                pending: due,
                claimed: 0,
                dispatched: 0,
                dead,
                oldest_pending_age_seconds: age,
            },
            due,
            oldest_due_s: oldest_due,
            expired_claims: 0,
            parked: 0,
            claims_by: Vec::new(),
            pending_by_topic: Vec::new(),
            dead_by_topic: Vec::new(),
        }
    }

    fn relay(last_claim_ago_s: Option<i64>, now: DateTime<Utc>) -> RelayRecord {
        RelayRecord {
            relay_id: "r1".into(),
            instance: String::new(),
            host: "h".into(),
            pid: 1,
            version: "0".into(),
            sink: "stdout".into(),
            in_flight: 0,
            started_at: now,
            last_seen: now,
            last_seen_ago_s: 0.0,
            last_claim_at: last_claim_ago_s.map(|s| now - chrono::Duration::seconds(s)),
            destinations: Vec::new(),
        }
    }

    const LIMITS: Limits = Limits {
        max_age: Duration::from_secs(60),
        max_dead: 0,
        stuck_after: Duration::from_secs(30),
    };

    const NONE_HELD: outbox::store::HeldKeys = outbox::store::HeldKeys {
        blocked_keys: 0,
        held: 0,
        oldest_held_age_seconds: None,
    };

    fn unpaused() -> PauseState {
        PauseState {
            paused: false,
            reason: None,
            changed_at: None,
            topics: Vec::new(),
        }
    }

    #[test]
    fn parked_rows_block_without_the_ordering_and_do_not_hide_stuck_ones() {
        let p = unpaused();
        // Parked rows seen without --ordered: BLOCKED, not OK or DEAD.
        let mut o = overview(0, None, Some(30), 1);
        o.parked = 7;
        let v = verdict(&o, &[], &p, &NONE_HELD, None, &LIMITS);
        assert_eq!(v.state, "BLOCKED", "{v:?}");
        assert!(v.text.starts_with("7 messages are parked"), "{v:?}");
        // With --ordered, 7 held of which 5 parked: 2 held rows are due; 3 more due rows
        // and no relay: those 3 are stuck.
        let mut o = overview(5, Some(95), Some(95), 1);
        o.parked = 5;
        let held = outbox::store::HeldKeys {
            blocked_keys: 1,
            held: 7,
            oldest_held_age_seconds: Some(95),
        };
        let due_held = outbox::store::DueHeld {
            held: 2,
            oldest_free_due_s: Some(95),
        };
        let v = verdict(&o, &[], &p, &held, Some(&due_held), &LIMITS);
        assert_eq!(
            (v.state, v.text.as_str()),
            ("STUCK", "3 messages due for 95 s and no relay is alive")
        );
    }

    #[test]
    fn verdicts_in_the_order_an_operator_acts_on() {
        let now = Utc::now();
        let p = unpaused();
        let v = verdict(
            &overview(1204, Some(95), Some(95), 3),
            &[],
            &p,
            &NONE_HELD,
            None,
            &LIMITS,
        );
        assert_eq!(v.state, "STUCK");
        assert_eq!(v.text, "1,204 messages due for 95 s and no relay is alive");
        // A relay claimed a moment ago: not stuck, but behind.
        let v = verdict(
            &overview(1204, Some(840), Some(840), 0),
            &[relay(Some(2), now)],
            &p,
            &NONE_HELD,
            None,
            &LIMITS,
        );
        assert_eq!(
            (v.state, v.text.as_str()),
            (
                "BEHIND",
                "the oldest due message has waited 14 min (limit 60 s)"
            )
        );
        // A message written long ago but not due yet (delayed): not late.
        let v = verdict(
            &overview(0, None, Some(3_600), 0),
            &[relay(Some(2), now)],
            &p,
            &NONE_HELD,
            None,
            &LIMITS,
        );
        assert_eq!(v.state, "OK", "{v:?}");
        // A live relay that has not claimed for long: stuck.
        let v = verdict(
            &overview(5, Some(40), Some(40), 0),
            &[relay(Some(300), now)],
            &p,
            &NONE_HELD,
            None,
            &LIMITS,
        );
        assert_eq!(v.state, "STUCK");
        let topic_paused = PauseState {
            topics: vec![outbox::store::TopicPause {
                pattern: "billing.>".into(),
                reason: "redeploy".into(),
                by: "dana".into(),
                paused_at: now,
            }],
            ..unpaused()
        };
        let v = verdict(
            &overview(3, Some(64), Some(64), 0),
            &[relay(None, now)],
            &topic_paused,
            &NONE_HELD,
            None,
            &LIMITS,
        );
        assert_eq!(v.state, "PAUSED", "{v:?}");
        assert!(
            v.text.contains("topic pauses are in force (billing.>)"),
            "{v:?}"
        );
        let v = verdict(
            &overview(3, Some(64), Some(64), 0),
            &[],
            &topic_paused,
            &NONE_HELD,
            None,
            &LIMITS,
        );
        assert_eq!(v.state, "STUCK", "no relay alive at all: {v:?}");
        let v = verdict(
            &overview(0, None, None, 10),
            &[],
            &p,
            &NONE_HELD,
            None,
            &LIMITS,
        );
        assert_eq!(v.state, "DEAD");
        let v = verdict(
            &overview(0, None, None, 0),
            &[],
            &p,
            &NONE_HELD,
            None,
            &LIMITS,
        );
        assert_eq!(v.state, "OK");
        let paused = PauseState {
            paused: true,
            reason: Some("deploy".into()),
            ..unpaused()
        };
        let v = verdict(
            &overview(5, Some(400), Some(400), 0),
            &[],
            &paused,
            &NONE_HELD,
            None,
            &LIMITS,
        );
        assert_eq!(v.state, "PAUSED");
    }

    /// Ordered keys behind dead letters: their rows are due but wait by design, so they
    /// are neither stuck nor merely behind; the verdict names them and the way out.
    #[test]
    fn rows_held_behind_dead_letters_are_blocked_not_stuck() {
        let now = Utc::now();
        let held = outbox::store::HeldKeys {
            blocked_keys: 1,
            held: 5,
            oldest_held_age_seconds: Some(840),
        };
        let all_due_held = outbox::store::DueHeld {
            held: 5,
            oldest_free_due_s: None,
        };
        // Every due row is held, no relay alive: not STUCK.
        let v = verdict(
            &overview(5, Some(840), Some(840), 1),
            &[],
            &unpaused(),
            &held,
            Some(&all_due_held),
            &LIMITS,
        );
        assert_eq!(v.state, "BLOCKED", "{v:?}");
        assert!(
            v.text.starts_with(
                "5 messages of 1 ordered key wait behind dead letters (oldest 14 min)"
            ),
            "{v:?}"
        );
        // Other due rows and no relay: STUCK first, counting only the others.
        let v = verdict(
            &overview(8, Some(840), Some(840), 1),
            &[],
            &unpaused(),
            &held,
            Some(&outbox::store::DueHeld {
                held: 5,
                oldest_free_due_s: Some(840),
            }),
            &LIMITS,
        );
        assert_eq!(
            (v.state, v.text.as_str()),
            ("STUCK", "3 messages due for 840 s and no relay is alive")
        );
        // A relay claiming: BLOCKED before BEHIND.
        let v = verdict(
            &overview(5, Some(840), Some(840), 1),
            &[relay(Some(2), now)],
            &unpaused(),
            &held,
            Some(&all_due_held),
            &LIMITS,
        );
        assert_eq!(v.state, "BLOCKED");
    }

    /// Due rows counted as held by per-key ordering (behind a key's first row that is not
    /// due yet) are not stuck; the others still are.
    #[test]
    fn due_rows_held_by_ordering_are_not_stuck() {
        let p = unpaused();
        let o = overview(3, Some(95), Some(95), 0);
        let all_held = outbox::store::DueHeld {
            held: 3,
            oldest_free_due_s: None,
        };
        let v = verdict(&o, &[], &p, &NONE_HELD, Some(&all_held), &LIMITS);
        assert_eq!(v.state, "OK", "{v:?}");
        // One held, two free due for 12 s (the held one for 95 s): the free ones' age.
        let one_held = outbox::store::DueHeld {
            held: 1,
            oldest_free_due_s: Some(12),
        };
        let v = verdict(&o, &[], &p, &NONE_HELD, Some(&one_held), &LIMITS);
        assert_eq!(
            v.state, "OK",
            "due for 12 s, not --stuck-after (30 s): {v:?}"
        );
        let one_held = outbox::store::DueHeld {
            held: 1,
            oldest_free_due_s: Some(40),
        };
        let v = verdict(&o, &[], &p, &NONE_HELD, Some(&one_held), &LIMITS);
        assert_eq!(
            (v.state, v.text.as_str()),
            ("STUCK", "2 messages due for 40 s and no relay is alive")
        );
        // Nor are they a paused topic's rows: with a topic pause in force and a relay
        // alive, held rows alone are no reason to say PAUSED.
        let topic_paused = PauseState {
            topics: vec![outbox::store::TopicPause {
                pattern: "zzz".into(),
                reason: "test".into(),
                by: "me".into(),
                paused_at: Utc::now(),
            }],
            ..unpaused()
        };
        let v = verdict(
            &o,
            &[relay(Some(300), Utc::now())],
            &topic_paused,
            &NONE_HELD,
            Some(&all_held),
            &LIMITS,
        );
        assert_eq!(
            (v.state, v.text.as_str()),
            ("OK", "OK (1 topic pause in force: their rows wait)")
        );
        // Held rows are not late either: BEHIND counts the free ones' age.
        let v = verdict(
            &overview(3, Some(900), Some(900), 0),
            &[relay(Some(2), Utc::now())],
            &p,
            &NONE_HELD,
            Some(&outbox::store::DueHeld {
                held: 3,
                oldest_free_due_s: None,
            }),
            &LIMITS,
        );
        assert_eq!(v.state, "OK", "{v:?}");
    }

    /// Limits past i64's seconds are the largest, not negative: nothing is stuck or late.
    #[test]
    fn huge_limits_do_not_wrap() {
        let huge = Limits {
            max_age: Duration::from_secs(u64::MAX),
            max_dead: 0,
            stuck_after: Duration::from_secs(u64::MAX),
        };
        let v = verdict(
            &overview(5, Some(900), Some(900), 0),
            &[],
            &unpaused(),
            &NONE_HELD,
            None,
            &huge,
        );
        assert_eq!(v.state, "OK", "{v:?}");
    }

    #[test]
    fn control_characters_never_reach_the_terminal() {
        assert_eq!(safe("a\u{1b}[31mb\u{7}"), "a\\u{1b}[31mb\\u{7}");
        assert_eq!(group(1_234_567), "1,234,567");
        assert_eq!(clip("abcdef", 4), "abc…");
    }
}
