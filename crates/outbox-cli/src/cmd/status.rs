//! `outbox status`: counts by status, due and expired claims, live relays, pauses and
//! the verdict ([`outbox::verdict`]); what the dashboard's overview shows too.

use super::OrderingArgs;
use crate::shared::{Format, GlobalArgs, open_checked, out, parse_duration};
use crate::text::{counted, group, human_f64, safe};
use outbox::store::{Overview, PauseState, RELAY_EXPIRY, RelayRecord, Store};
use outbox::verdict::{Inputs, Limits, Verdict, decide};
use std::process::ExitCode;
use std::time::Duration;

/// `outbox status`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// One JSON object: pending, claimed, dispatched, dead, oldest_pending_age_seconds,
    /// paused, due, relays, topic_pauses, verdict, ….
    #[arg(long)]
    json: bool,
    /// Also the 10 largest topics of pending and of dead rows.
    #[arg(long)]
    by_topic: bool,
    /// Exit 1 unless the verdict is OK (for cron jobs and probes).
    #[arg(long)]
    check: bool,
    #[command(flatten)]
    limits: LimitsArgs,
    // With --ordered, rows of ordered keys waiting behind dead letters are BLOCKED,
    // not STUCK or BEHIND.
    #[command(flatten)]
    ordering: OrderingArgs,
}

/// What `outbox status` prints, and whether it fails unless the verdict is OK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StatusOptions {
    /// Lines for people, or one JSON object.
    pub(crate) format: Format,
    /// Also the 10 largest topics of pending and of dead rows.
    pub(crate) by_topic: bool,
    /// Exit 1 unless the verdict is OK.
    pub(crate) check: bool,
}

/// Runs `outbox status`.
pub(crate) async fn run(global: &GlobalArgs, args: &Args) -> anyhow::Result<ExitCode> {
    let store = open_checked(global).await?;
    let options = StatusOptions {
        format: Format::json_if(args.json),
        by_topic: args.by_topic,
        check: args.check,
    };
    status(
        &store,
        &options,
        &args.limits.limits(),
        &args.ordering.ordering(),
    )
    .await
}

/// The verdict's limits, as `status` and `serve` take them.
#[derive(clap::Args, Debug, Clone)]
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

/// The verdict's inputs from what `status` reads: the overview, the live relays, the
/// pause switch and topic pauses, what per-key ordering holds behind dead letters
/// (`held`) and of the due rows (`due_held`).
fn verdict_inputs(
    o: &Overview,
    relays: &[RelayRecord],
    pause: &PauseState,
    held: &outbox::store::HeldKeys,
    due_held: Option<&outbox::store::DueHeld>,
) -> Inputs {
    Inputs {
        due: o.due,
        oldest_due_s: o.oldest_due_s,
        parked: o.parked,
        dead: o.counts.dead,
        relay_last_claims_s: relays.iter().map(last_claim_ago_s).collect(),
        paused: pause.paused,
        pause_reason: pause.reason.clone(),
        topic_pauses: pause.topics.iter().map(|p| p.pattern.clone()).collect(),
        held: held.held,
        blocked_keys: held.blocked_keys,
        oldest_held_age_s: held.oldest_held_age_seconds,
        due_held: due_held.map(|d| outbox::verdict::DueHeld {
            held: d.held,
            oldest_free_due_s: d.oldest_free_due_s,
        }),
    }
}

/// Seconds since the relay's last claim that returned rows, on the database clock alone
/// (the time since its last heartbeat plus how long before that heartbeat it claimed).
fn last_claim_ago_s(r: &RelayRecord) -> Option<f64> {
    let at = r.last_claim_at?;
    let before_beat = (r.last_seen - at).num_milliseconds().max(0) as f64 / 1000.0;
    Some(r.last_seen_ago_s + before_beat)
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
                human_f64(t.age_s),
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
        let verdict = decide(
            &verdict_inputs(&overview, &relays, &pause, &held, due_held.as_ref()),
            limits,
        );
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
    options: &StatusOptions,
    limits: &Limits,
    ordering: &outbox::store::KeyOrdering,
) -> anyhow::Result<ExitCode> {
    let StatusOptions {
        format,
        by_topic,
        check,
    } = *options;
    let top = if by_topic { 10 } else { 0 };
    let report = StatusReport::read(store, top, limits, ordering).await?;
    let orphaned = report.orphaned();
    let (o, pause, relays, v) = (
        &report.overview,
        &report.pause,
        &report.relays,
        &report.verdict,
    );
    if format == Format::Json {
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
                format!("last claim {} ago", human_f64(s))
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
            if v.state.is_ok() {
                v.text.clone()
            } else {
                format!("{}: {}", v.state, v.text)
            }
        ));
        out(&t);
    }
    Ok(if check && !v.state.is_ok() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{DateTime, Utc};
    use outbox::Counts;
    use outbox::verdict::State;

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

    /// The relays' last claims reach the verdict on the database clock: a claim a moment
    /// ago is claiming, one long ago is not; the rest of the overview as it was read.
    #[test]
    fn the_inputs_are_what_status_read() {
        let now = Utc::now();
        let unpaused = PauseState {
            paused: false,
            reason: None,
            changed_at: None,
            topics: Vec::new(),
        };
        let none_held = outbox::store::HeldKeys::default();
        let verdict = |o: &Overview, relays: &[RelayRecord]| {
            decide(
                &verdict_inputs(o, relays, &unpaused, &none_held, None),
                &Limits::default(),
            )
        };
        let v = verdict(
            &overview(1204, Some(840), Some(840), 0),
            &[relay(Some(2), now)],
        );
        assert_eq!(
            (v.state, v.text.as_str()),
            (
                State::Behind,
                "the oldest due message has waited 14 min (limit 60 s)"
            )
        );
        let v = verdict(
            &overview(5, Some(40), Some(40), 0),
            &[relay(Some(300), now)],
        );
        assert_eq!(v.state, State::Stuck, "{v:?}");
        let v = verdict(&overview(0, None, None, 10), &[]);
        assert_eq!(v.state, State::Dead, "{v:?}");
        let i = verdict_inputs(
            &overview(3, Some(5), Some(5), 1),
            &[relay(None, now)],
            &unpaused,
            &none_held,
            Some(&outbox::store::DueHeld {
                held: 1,
                oldest_free_due_s: Some(4),
            }),
        );
        assert_eq!(
            (i.due, i.oldest_due_s, i.dead, i.relay_last_claims_s.clone()),
            (3, Some(5), 1, vec![None])
        );
        assert_eq!(
            i.due_held,
            Some(outbox::verdict::DueHeld {
                held: 1,
                oldest_free_due_s: Some(4),
            })
        );
    }
}
