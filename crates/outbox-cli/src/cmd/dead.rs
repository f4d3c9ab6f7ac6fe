//! `outbox dead list|show|discard`: dead letters, which of them block their key, and
//! how a payload is shown.

use super::OrderingArgs;
use super::change::{ChangeArgs, SelectArgs, change_dead};
use crate::shared::{GlobalArgs, open_checked, out};
use crate::text::{clip, counted, group, one_line, safe, safe_multiline};
use outbox::store::{DeadLetter, ReplayAction, Store};
use std::process::ExitCode;

/// `outbox dead …`
#[derive(clap::Subcommand, Debug)]
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

/// Runs `outbox dead …`.
pub(crate) async fn run(global: &GlobalArgs, cmd: &DeadCommand) -> anyhow::Result<ExitCode> {
    let store = open_checked(global).await?;
    dead(&store, cmd).await
}

async fn dead(store: &dyn Store, cmd: &DeadCommand) -> anyhow::Result<ExitCode> {
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
                    counted(u64::try_from(blocking).unwrap_or(u64::MAX), "dead letter"),
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
                    group(u64::try_from(rows.len()).unwrap_or(u64::MAX)),
                    group(total)
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
