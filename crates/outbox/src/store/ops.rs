//! The operator's side of a store: dead letters and their audited replay or discard, the
//! relay registry, topic pauses and the sampled overview behind `outbox status` and the
//! store gauges. Types only; every store implements the [`super::Store`] methods that use
//! them, and the SQL filter of a [`DeadSelector`] is built once here for all three.

use crate::topic::TopicPattern;
use chrono::{DateTime, Utc};
use serde::Serialize;
use std::time::Duration;
use uuid::Uuid;

/// Which dead rows an operation applies to. Every criterion given must hold; an empty
/// selector selects nothing for [`super::Operations::replay`] (it refuses), and every dead row
/// for [`super::Operations::dead_letters`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeadSelector {
    /// Rows by primary key.
    pub ids: Vec<i64>,
    /// Rows by message id.
    pub message_ids: Vec<Uuid>,
    /// Rows whose primary key is in this inclusive range.
    pub id_range: Option<(i64, i64)>,
    /// Rows whose topic matches this pattern (`*` one token, `>` one or more at the end).
    pub topic: Option<TopicPattern>,
    /// Rows that died at most this long ago (database clock).
    pub died_within: Option<Duration>,
    /// Rows that died at least this long ago (database clock).
    pub died_before_ago: Option<Duration>,
    /// Rows that died at or after this time.
    pub died_after: Option<DateTime<Utc>>,
    /// Rows whose last error contains this text (case-insensitive).
    pub error_contains: Option<String>,
}

impl DeadSelector {
    /// True when no criterion is set.
    pub fn is_empty(&self) -> bool {
        self == &DeadSelector::default()
    }

    /// The selector as one line for the audit row and for operators, e.g.
    /// `ids=4,7 topic=orders.> error~"timeout"`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.ids.is_empty() {
            let ids: Vec<String> = self.ids.iter().map(i64::to_string).collect();
            parts.push(format!("ids={}", ids.join(",")));
        }
        if !self.message_ids.is_empty() {
            let ids: Vec<String> = self.message_ids.iter().map(Uuid::to_string).collect();
            parts.push(format!("message_ids={}", ids.join(",")));
        }
        if let Some((a, b)) = self.id_range {
            parts.push(format!("id_range={a}..={b}"));
        }
        if let Some(t) = &self.topic {
            parts.push(format!("topic={}", t.as_str()));
        }
        if let Some(d) = self.died_within {
            parts.push(format!("died_within={}s", d.as_secs()));
        }
        if let Some(d) = self.died_before_ago {
            parts.push(format!("died_before_ago={}s", d.as_secs()));
        }
        if let Some(t) = self.died_after {
            parts.push(format!("died_after={}", t.to_rfc3339()));
        }
        if let Some(e) = &self.error_contains {
            parts.push(format!("error~{e:?}"));
        }
        parts.join(" ")
    }
}

/// The SQL dialect a [`DeadSelector`] filter is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // each variant is used only when its store's feature is on
pub(crate) enum Dialect {
    /// PostgreSQL: `$n` placeholders, `timestamptz` columns, `~` regex.
    Postgres,
    /// SQLite: `?` placeholders, integer-millisecond columns, `REGEXP`.
    Sqlite,
    /// MySQL / MariaDB: `?` placeholders, `DATETIME(6)` UTC columns, `REGEXP`, message ids
    /// as hyphenated text, the time of death read from `dead_at` (the generated column
    /// behind the dead-row index, `available_at` of dead rows).
    MySql,
}

/// A [`DeadSelector`] as SQL: a condition on the messages table (no alias; `status = 3`
/// included) and the strings to bind, in order, after the placeholders numbered from
/// `first` (PostgreSQL) — the other stores use positional `?`. Integers, UUIDs and times
/// are inlined (they are formatted here from typed values, never from text); only the
/// topic regex and the error text are bound.
pub(crate) fn dead_filter(sel: &DeadSelector, d: Dialect, first: usize) -> (String, Vec<String>) {
    let mut cond = vec!["status = 3".to_owned()];
    let mut binds = Vec::new();
    let ph = |binds: &mut Vec<String>, v: String| {
        binds.push(v);
        match d {
            Dialect::Postgres => format!("${}", first + binds.len() - 1),
            Dialect::Sqlite | Dialect::MySql => "?".to_owned(),
        }
    };
    let now_minus = |ms: i64| match d {
        Dialect::Postgres => format!("now() - {ms} * interval '1 millisecond'"),
        Dialect::Sqlite => format!("{} - {ms}", super::SQLITE_NOW_MS),
        Dialect::MySql => format!("TIMESTAMPADD(MICROSECOND, -{ms} * 1000, UTC_TIMESTAMP(6))"),
    };
    // When a row died: `available_at` of a dead row (MySQL: the generated `dead_at`, which
    // is that and is indexed).
    let died = match d {
        Dialect::Postgres | Dialect::Sqlite => "available_at",
        Dialect::MySql => "dead_at",
    };
    if let Some(named) = named_filter(sel, d) {
        cond.push(named);
    }
    if let Some((a, b)) = sel.id_range {
        cond.push(format!("id BETWEEN {a} AND {b}"));
    }
    if let Some(t) = &sel.topic {
        let p = ph(&mut binds, t.regex());
        cond.push(match d {
            Dialect::Postgres => format!("topic ~ {p}"),
            Dialect::Sqlite | Dialect::MySql => format!("topic REGEXP {p}"),
        });
    }
    if let Some(w) = sel.died_within {
        cond.push(format!("{died} >= {}", now_minus(super::millis(w))));
    }
    if let Some(w) = sel.died_before_ago {
        cond.push(format!("{died} < {}", now_minus(super::millis(w))));
    }
    if let Some(t) = sel.died_after {
        let ms = t.timestamp_millis();
        cond.push(match d {
            Dialect::Postgres => format!("available_at >= to_timestamp({ms} / 1000.0)"),
            Dialect::Sqlite => format!("available_at >= {ms}"),
            Dialect::MySql => format!(
                "dead_at >= TIMESTAMPADD(MICROSECOND, {ms} * 1000, TIMESTAMP '1970-01-01 00:00:00')"
            ),
        });
    }
    if let Some(e) = &sel.error_contains {
        let p = ph(&mut binds, e.to_lowercase());
        cond.push(match d {
            Dialect::Postgres => format!("strpos(lower(last_error), {p}) > 0"),
            Dialect::Sqlite => format!("instr(lower(last_error), {p}) > 0"),
            Dialect::MySql => format!("LOCATE({p}, LOWER(last_error)) > 0"),
        });
    }
    (cond.join(" AND "), binds)
}

/// The rows `sel` names by id or message id, whatever their status, as one SQL condition
/// (`None` when it names none). `dead_filter` uses it for its own ids; the stores use it to
/// find which named rows a replay must refuse.
pub(crate) fn named_filter(sel: &DeadSelector, d: Dialect) -> Option<String> {
    let mut id_or = Vec::new();
    if !sel.ids.is_empty() {
        id_or.push(format!("id IN ({})", join_ids(&sel.ids)));
    }
    if !sel.message_ids.is_empty() {
        let ids: Vec<String> = sel
            .message_ids
            .iter()
            .map(|u| match d {
                Dialect::Postgres => format!("'{}'::uuid", u.hyphenated()),
                Dialect::Sqlite | Dialect::MySql => format!("'{}'", u.hyphenated()),
            })
            .collect();
        id_or.push(format!("message_id IN ({})", ids.join(",")));
    }
    (!id_or.is_empty()).then(|| format!("({})", id_or.join(" OR ")))
}

fn join_ids(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

/// A dead row as `outbox dead list` / `dead show` print it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetter {
    /// Primary key.
    pub id: i64,
    /// The message id (stable across replays).
    pub message_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Key, if any.
    pub key: Option<String>,
    /// Attempts counted when it died.
    pub attempts: i32,
    /// When it was enqueued (database clock).
    pub occurred_at: DateTime<Utc>,
    /// When it was quarantined (database clock).
    pub died_at: DateTime<Utc>,
    /// Why (the last error the relay recorded).
    pub last_error: Option<String>,
    /// The stored headers, as the JSON text the store holds (possibly malformed: a row
    /// quarantined because its headers could not be read keeps them as they are).
    pub headers: String,
    /// Payload size, in bytes.
    pub payload_bytes: i64,
    /// The payload, only when asked for.
    #[serde(skip)]
    pub payload: Option<Vec<u8>>,
    /// The last replay that moved this row back to pending (it died again since).
    pub replay_id: Option<i64>,
    /// Later messages of the same topic and key not yet delivered (pending or claimed):
    /// where the topic is ordered ([`crate::store::KeyOrdering`]), they wait behind this
    /// dead letter until it is replayed or discarded. 0 without a key.
    pub waiting_behind: i64,
}

/// What a [`ReplayRequest`] does to the selected dead rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayAction {
    /// Back to pending: same message id, attempts reset to 0, `replay_id` recorded.
    Replay,
    /// Deleted (the operator decided they will never be delivered).
    Discard,
    /// Deleted by dead-row retention (`outbox purge --dead-older-than`).
    Purge,
}

impl ReplayAction {
    /// The name stored in the audit row: `replay`, `discard` or `purge`.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayAction::Replay => "replay",
            ReplayAction::Discard => "discard",
            ReplayAction::Purge => "purge",
        }
    }
}

impl ReplayRequest {
    /// What the audit row's `selection` records: the selector, and the limit and rate
    /// when given (`topic=orders.> limit=100 rate=50/s`).
    pub fn describe(&self) -> String {
        let mut d = self.selector.describe();
        if let Some(l) = self.limit {
            d.push_str(&format!(" limit={l}"));
        }
        if let Some(r) = self.rate_per_s {
            d.push_str(&format!(" rate={r}/s"));
        }
        d
    }
}

/// An audited operation on dead rows ([`super::Operations::replay`]).
#[derive(Debug, Clone)]
pub struct ReplayRequest {
    /// Which rows; must not be empty.
    pub selector: DeadSelector,
    /// Replay or discard.
    pub action: ReplayAction,
    /// Most rows to change (in id order); `None`: every selected row.
    pub limit: Option<u32>,
    /// Who (a person or a tool); must not be empty.
    pub by: String,
    /// Why; must not be empty.
    pub reason: String,
    /// Replay only: the replayed rows become due one after another at this rate (rows per
    /// second, in id order), so consumers are not flooded; `None`: all due at once.
    pub rate_per_s: Option<f64>,
    /// Count and sample only; nothing changes and no audit row is written.
    pub dry_run: bool,
    /// Add the changed rows to this earlier audit row instead of writing a new one (a
    /// dead-row purge that runs in several bounded batches is one audited operation).
    pub append_to: Option<i64>,
}

/// A row named by id or message id that the operation refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Refused {
    /// The id or message id as given.
    pub what: String,
    /// Why: `unknown` or the row's status (`pending`, `claimed`, `dispatched`).
    pub reason: String,
}

/// What a [`ReplayRequest`] did (or, on a dry run, would do).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayOutcome {
    /// The audit row (`None` on a dry run, or when nothing was selected).
    pub replay_id: Option<i64>,
    /// Rows changed (on a dry run: rows that would change).
    pub count: u64,
    /// The changed (or, on a dry run, selected) rows' primary keys, at most 20.
    pub sample: Vec<i64>,
    /// Named rows that are not dead or do not exist: never changed.
    pub refused: Vec<Refused>,
}

/// One audit row of `replays`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayRecord {
    /// Audit id (what replayed rows record as `replay_id`).
    pub id: i64,
    /// When (database clock).
    pub at: DateTime<Utc>,
    /// Who.
    pub by: String,
    /// Why.
    pub reason: String,
    /// `replay`, `discard` or `purge`.
    pub action: String,
    /// The selector, as [`DeadSelector::describe`] wrote it.
    pub selection: String,
    /// Rows changed.
    pub count: i64,
}

/// What a relay writes to the registry every heartbeat ([`super::Registry::heartbeat`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RelayHeartbeat {
    /// The relay's id (also written to `claimed_by` of its claims).
    pub relay_id: String,
    /// This relay's instance: a UUID drawn when the `Relay` was made, so two relays
    /// under one id (two processes, or two `Relay`s in one program) keep a registry row
    /// each (the registry is keyed by `(relay_id, instance)`).
    pub instance: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: i64,
    /// The relay's lease: a claim whose lease ends at least this long after the
    /// instance's `started_at` was made by it or a later instance, not by an earlier
    /// process of the same id ([`ClaimsBy::instance`]).
    pub lease: Duration,
    /// The build's version.
    pub version: String,
    /// Where it publishes, without secrets (`Router::describe`).
    pub sink: String,
    /// Messages in flight (claimed, not yet settled) right now.
    pub in_flight: i64,
    /// How long ago its last claim returned rows; `None` when it has not claimed any yet.
    pub last_claim_ago: Option<Duration>,
    /// Its destinations and their state as its router judges them now
    /// (`Router::destination_states`).
    pub destinations: Vec<DestinationState>,
}

/// One destination of a relay and its state, as the relay's heartbeat reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct DestinationState {
    /// The destination, without secrets (`Sink::describe`).
    pub name: String,
    /// `up`, `down` (failing) or `open` (breaker open: waiting for its next probe).
    pub state: String,
}

/// The JSON text a registry row keeps its destinations in.
pub(crate) fn destinations_json(d: &[DestinationState]) -> String {
    serde_json::to_string(d).unwrap_or_else(|_| "[]".to_owned())
}

/// The destinations of a registry row's JSON text; none when it cannot be read (a row
/// written before the registry kept them).
pub(crate) fn parse_destinations(text: Option<&str>) -> Vec<DestinationState> {
    text.and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or_default()
}

/// An operator's change other than a replay, for the audit ([`super::Operations::audit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    /// Who (a user name, or the admin token's name).
    pub by: String,
    /// Why, as given (may be empty for a resume).
    pub reason: String,
    /// `pause` or `resume` (at most 16 bytes).
    pub action: String,
    /// What it applied to: `all topics`, or `topics PATTERN`.
    pub selection: String,
}

/// A registry row, as `outbox status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RelayRecord {
    /// The relay's id.
    pub relay_id: String,
    /// The relay's instance ([`RelayHeartbeat::instance`]; empty for a row written
    /// before the registry kept instances).
    pub instance: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: i64,
    /// Version.
    pub version: String,
    /// Where it publishes (no secrets).
    pub sink: String,
    /// Messages in flight at the last heartbeat.
    pub in_flight: i64,
    /// When it first registered (database clock).
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat (database clock).
    pub last_seen: DateTime<Utc>,
    /// Seconds since the last heartbeat (database clock).
    pub last_seen_ago_s: f64,
    /// When its last claim returned rows (database clock, from the heartbeat).
    pub last_claim_at: Option<DateTime<Utc>>,
    /// Its destinations and their state at the last heartbeat (none from a relay of an
    /// older version).
    pub destinations: Vec<DestinationState>,
}

/// A topic pause ([`super::Operations::pause_topic`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopicPause {
    /// The topic pattern paused.
    pub pattern: String,
    /// Why.
    pub reason: String,
    /// Who.
    pub by: String,
    /// When (database clock).
    pub paused_at: DateTime<Utc>,
}

/// Claimed rows of one `claimed_by`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClaimsBy {
    /// `claimed_by` (a relay id).
    pub relay_id: String,
    /// The live registry row ([`RelayRecord::instance`]) of this relay id whose lifetime
    /// holds these claims: the latest-started one whose `started_at` plus lease is not
    /// after the claims' lease end. `None` when no live relay has this id, or when the
    /// claims were made before every live instance of it started (by an earlier process
    /// of the id, killed without releasing them: they come back when their lease ends).
    pub instance: Option<String>,
    /// Claimed rows.
    pub claimed: i64,
    /// Of those, rows whose lease has ended (database clock).
    pub expired: i64,
}

/// A sampled view of the store for `outbox status`, the verdict and the store gauges
/// ([`super::Views::overview`]). A handful of statements; the per-status counts scan the
/// table, the rest read the live and dead indexes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Overview {
    /// Rows by status and the oldest pending age.
    pub counts: super::Counts,
    /// Rows due now: pending and due, or claimed with an ended lease.
    pub due: i64,
    /// Seconds the oldest due row has been due (database clock); `None` when none is due.
    pub oldest_due_s: Option<i64>,
    /// Claimed rows whose lease has ended.
    pub expired_claims: i64,
    /// Pending rows parked behind a dead letter of their key by strict per-key ordering
    /// ([`super::Maintenance::park_held`]): not due, and waiting by design.
    pub parked: i64,
    /// Claimed rows by claimant.
    pub claims_by: Vec<ClaimsBy>,
    /// Pending rows by topic, the largest first (top N).
    pub pending_by_topic: Vec<(String, i64)>,
    /// Dead rows by topic, the largest first (top N).
    pub dead_by_topic: Vec<(String, i64)>,
}

/// What holds back the cleanup of dead row versions on the database server, read by
/// [`super::Views::cleanup_horizon`]. Every dispatched, rescheduled or deleted outbox row
/// leaves a dead version behind; while a transaction that started before it is open (or a
/// replication slot or prepared transaction pins the same horizon), the server may not
/// remove it, so the claim's index scan walks more and more of them: claims slow down
/// with no error. Sampled every 15 s by the relay into the gauges
/// `outbox_oldest_transaction_age_seconds` and `outbox_oldest_xmin_age_transactions`, and
/// shown by `outbox status`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CleanupHorizon {
    /// The oldest open transaction of another session (or prepared transaction) that
    /// holds the horizon back; `None` when there is none.
    pub oldest: Option<OldTransaction>,
    /// PostgreSQL: the age, in transaction ids, of the oldest `xmin` that holds back
    /// cleanup in this database: sessions (`pg_stat_activity.backend_xmin`/`backend_xid`),
    /// prepared transactions (`pg_prepared_xacts`) and replication slots
    /// (`pg_replication_slots.xmin`). `None` elsewhere.
    pub xmin_age: Option<i64>,
    /// PostgreSQL: the replication slot with the oldest `xmin`, as (slot name, age in
    /// transaction ids); a slot whose consumer is gone holds the horizon for ever.
    pub slot: Option<(String, i64)>,
    /// MySQL/MariaDB: InnoDB's history list length (undo log records not purged yet),
    /// when the server tells it.
    pub history_length: Option<i64>,
}

/// One open transaction that holds back cleanup ([`CleanupHorizon::oldest`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OldTransaction {
    /// `session` (an open transaction of a connection) or `prepared` (a two-phase
    /// transaction prepared and neither committed nor rolled back).
    pub kind: String,
    /// Seconds since the transaction began (database clock; whole seconds on MariaDB).
    pub age_s: f64,
    /// The server's process or connection id (`pg_stat_activity.pid`, MySQL's
    /// `PROCESSLIST` id): `SELECT pg_terminate_backend(pid)` / `KILL id` ends it.
    pub pid: Option<i64>,
    /// The database user it runs as (the owner of a prepared transaction).
    pub user: Option<String>,
    /// The client's `application_name` (PostgreSQL) or host (MySQL), when it gave one.
    pub application: Option<String>,
    /// The session's state (`idle in transaction`, `active`, …; InnoDB's `trx_state`).
    pub state: Option<String>,
    /// The global transaction id of a prepared transaction (`COMMIT PREPARED 'gid'`).
    pub gid: Option<String>,
}

impl TopicPattern {
    /// The pattern as an anchored regular expression over a whole topic, in the syntax
    /// PostgreSQL (`~`), MySQL/MariaDB and SQLite (`REGEXP`, the `regex` crate) share:
    /// `*` is `[^.]+`, a final `>` is `.+`, and every other character is matched
    /// literally: ASCII letters, digits, `_` and non-ASCII characters as themselves, `<`
    /// and `>` as a bracket (`[<]`: the `regex` crate reads `\<` and `\>` as word
    /// boundaries, PostgreSQL and PCRE as the characters), other punctuation escaped with
    /// a backslash, which all three read as the character itself.
    pub fn regex(&self) -> String {
        let mut re = String::from("^");
        for (i, t) in self.as_str().split('.').enumerate() {
            if i > 0 {
                re.push_str("\\.");
            }
            match t {
                "*" => re.push_str("[^.]+"),
                ">" => re.push_str(".+"),
                lit => {
                    for c in lit.chars() {
                        if c.is_ascii_alphanumeric() || !c.is_ascii() || c == '_' {
                            re.push(c);
                        } else if c == '<' || c == '>' {
                            re.push('[');
                            re.push(c);
                            re.push(']');
                        } else {
                            re.push('\\');
                            re.push(c);
                        }
                    }
                }
            }
        }
        re.push('$');
        re
    }
}

/// The named rows of `sel` (ids and message ids) that are not dead: `found` holds the
/// named rows that exist, as (id, message id, status).
pub(crate) fn refusals(sel: &DeadSelector, found: &[(i64, Uuid, i16)]) -> Vec<Refused> {
    let status_name = |s: i16| match s {
        super::status::PENDING => "pending, not dead",
        super::status::CLAIMED => "claimed, not dead",
        super::status::DISPATCHED => "dispatched, not dead",
        _ => "dead",
    };
    let mut refused = Vec::new();
    for id in &sel.ids {
        match found.iter().find(|f| f.0 == *id) {
            None => refused.push(Refused {
                what: id.to_string(),
                reason: "unknown id".into(),
            }),
            Some(f) if f.2 != super::status::DEAD => refused.push(Refused {
                what: id.to_string(),
                reason: status_name(f.2).into(),
            }),
            Some(_) => {}
        }
    }
    for mid in &sel.message_ids {
        match found.iter().find(|f| f.1 == *mid) {
            None => refused.push(Refused {
                what: mid.to_string(),
                reason: "unknown message id".into(),
            }),
            Some(f) if f.2 != super::status::DEAD => refused.push(Refused {
                what: mid.to_string(),
                reason: status_name(f.2).into(),
            }),
            Some(_) => {}
        }
    }
    refused
}

/// Checks a request before any SQL runs.
pub(crate) fn validate(req: &ReplayRequest) -> crate::Result<()> {
    let bad = |m: &str| Err(crate::Error::InvalidRequest(m.to_owned()));
    if req.selector.is_empty() {
        return bad(
            "select the dead rows to change (ids, an id range, a topic pattern, a time window or error text): an empty selector would take every dead row",
        );
    }
    if req.reason.trim().is_empty() {
        return bad("a reason is required (it is kept in the audit row)");
    }
    if req.by.trim().is_empty() {
        return bad("who is doing this is required (it is kept in the audit row)");
    }
    if let Some(r) = req.rate_per_s
        && !(r.is_finite() && r >= MIN_RATE_PER_S)
    {
        return bad("the replay rate must be at least 0.01 rows per second (one row every 100 s)");
    }
    if req.limit == Some(0) {
        return bad("the limit must be at least 1");
    }
    Ok(())
}

/// The slowest replay rate accepted, in rows per second (one row every 100 s).
pub const MIN_RATE_PER_S: f64 = 0.01;

/// The longest a rate may spread one replay over: 7 days.
pub const MAX_SPREAD: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// Refuses a replay whose `n` rows at `rate_per_s` would spread over more than
/// [`MAX_SPREAD`] (rows parked as pending for months look like a lost message).
pub(crate) fn check_spread(n: usize, rate_per_s: Option<f64>) -> crate::Result<()> {
    if let Some(r) = rate_per_s
        && (n.saturating_sub(1) as f64) / r > MAX_SPREAD.as_secs_f64()
    {
        return Err(crate::Error::InvalidRequest(format!(
            "{n} rows at {r}/s would take {:.0} days to become due: raise --rate or use --limit (at most 7 days)",
            (n.saturating_sub(1) as f64) / r / 86_400.0
        )));
    }
    Ok(())
}

/// The delay of the `k`-th replayed row (0-based, id order) at `rate_per_s`, in ms.
pub(crate) fn spread_ms(k: usize, rate_per_s: Option<f64>) -> i64 {
    match rate_per_s {
        Some(r) => super::round_saturating((k as f64) * 1000.0 / r),
        None => 0,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_spreads_over_at_most_seven_days() {
        assert!(
            check_spread(6_049, Some(0.01)).is_ok(),
            "6,048 gaps of 100 s = 7 days"
        );
        let e = check_spread(6_050, Some(0.01)).unwrap_err().to_string();
        assert!(e.contains("would take 7 days"), "{e}");
        assert!(check_spread(1_000_000, None).is_ok());
        assert_eq!(spread_ms(3, Some(2.0)), 1_500);
    }

    #[test]
    fn topic_regex_matches_what_the_pattern_matches() {
        let cases = [
            ("orders.>", "^orders\\..+$"),
            ("orders.*.v1", "^orders\\.[^.]+\\.v1$"),
            ("a-b+c", "^a\\-b\\+c$"),
            ("orders.<v2", "^orders\\.[<]v2$"),
        ];
        for (p, re) in cases {
            assert_eq!(TopicPattern::parse(p).unwrap().regex(), re);
        }
    }

    #[test]
    fn selector_filters_bind_only_text() {
        let sel = DeadSelector {
            ids: vec![3, 4],
            topic: Some(TopicPattern::parse("orders.>").unwrap()),
            error_contains: Some("TimeOut".into()),
            ..DeadSelector::default()
        };
        let (sql, binds) = dead_filter(&sel, Dialect::Postgres, 2);
        assert_eq!(
            sql,
            "status = 3 AND (id IN (3,4)) AND topic ~ $2 AND strpos(lower(last_error), $3) > 0"
        );
        assert_eq!(
            binds,
            vec!["^orders\\..+$".to_owned(), "timeout".to_owned()]
        );
        assert!(!sel.is_empty());
        assert!(DeadSelector::default().is_empty());
        assert_eq!(sel.describe(), "ids=3,4 topic=orders.> error~\"TimeOut\"");
    }

    #[test]
    fn mysql_filter_names_text_message_ids_and_reads_dead_at() {
        let mid = Uuid::parse_str("0190a0b0-c0d0-7e00-8f00-0000000000a1").unwrap();
        let sel = DeadSelector {
            message_ids: vec![mid],
            died_within: Some(Duration::from_secs(60)),
            ..DeadSelector::default()
        };
        let (sql, binds) = dead_filter(&sel, Dialect::MySql, 1);
        assert_eq!(
            sql,
            "status = 3 AND (message_id IN ('0190a0b0-c0d0-7e00-8f00-0000000000a1')) \
             AND dead_at >= TIMESTAMPADD(MICROSECOND, -60000 * 1000, UTC_TIMESTAMP(6))"
        );
        assert!(binds.is_empty());
    }
}
