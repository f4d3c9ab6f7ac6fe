//! The health verdict on an outbox: one [`State`] and one line for people, as
//! `outbox status` prints it, `outbox status --check` exits on and the dashboard shows it.
//!
//! [`decide`] is a pure function of plain values ([`Inputs`], read from a store's views:
//! the overview, the live relays, the pause switch and topic pauses, and what per-key
//! ordering holds back) and thresholds ([`Limits`]), so embedders can give the same
//! verdict from the same numbers.

use std::time::Duration;

/// What the verdict says. [`decide`] checks them in the order an operator acts on:
/// stuck (nothing moves), paused, blocked (ordered keys behind dead letters), behind,
/// dead letters; OK when none holds.
///
/// Serialized (and shown) in upper case: `STUCK`, `PAUSED`, `BLOCKED`, `BEHIND`, `DEAD`,
/// `OK`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum State {
    /// Rows have been due for at least [`Limits::stuck_after`] and no live relay claimed
    /// within it (or none is alive).
    Stuck,
    /// The pause switch is on, or rows wait while topic pauses are in force.
    Paused,
    /// Rows wait behind dead letters of their keys (per-key ordering).
    Blocked,
    /// The oldest due row has waited longer than [`Limits::max_age`].
    Behind,
    /// More dead letters than [`Limits::max_dead`].
    Dead,
    /// None of the above.
    Ok,
}

impl State {
    /// The state's name in upper case, as serialized: `"STUCK"`, …, `"OK"`.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Stuck => "STUCK",
            State::Paused => "PAUSED",
            State::Blocked => "BLOCKED",
            State::Behind => "BEHIND",
            State::Dead => "DEAD",
            State::Ok => "OK",
        }
    }

    /// True for [`State::Ok`].
    pub fn is_ok(self) -> bool {
        self == State::Ok
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The verdict: a state and one line for people. Serialized as
/// `{"state":"OK","text":"OK"}`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Verdict {
    /// What holds, the first of [`State`]'s order.
    pub state: State,
    /// One line for people: what holds and, where there is one, the way out (e.g. "1,204
    /// messages due for 95 s and no relay is alive").
    pub text: String,
}

/// Thresholds of the verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A row due for longer than this is BEHIND.
    pub max_age: Duration,
    /// More dead rows than this is DEAD.
    pub max_dead: i64,
    /// Rows due this long with no relay claiming is STUCK.
    pub stuck_after: Duration,
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

/// What per-key ordering holds back of the due rows (behind dead letters, or behind a
/// first row of their key that is not due yet), as a store's `due_held_by_order` reads
/// it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DueHeld {
    /// Due rows held back.
    pub held: i64,
    /// Seconds the oldest due row that nothing holds has been due; `None` when every due
    /// row is held.
    pub oldest_free_due_s: Option<i64>,
}

/// What the verdict is decided from: plain values of a store's views, on the database
/// clock (ages in whole seconds).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inputs {
    /// Rows due now: pending, available and not claimed (the overview's `due`).
    pub due: i64,
    /// Seconds the oldest due row has been due; `None` when none is due.
    pub oldest_due_s: Option<i64>,
    /// Rows parked behind dead letters of their keys (the overview's `parked`).
    pub parked: i64,
    /// Dead rows.
    pub dead: i64,
    /// One entry per live relay: seconds since its last claim that returned rows, `None`
    /// when it has not claimed any.
    pub relay_last_claims_s: Vec<Option<f64>>,
    /// The pause switch is on.
    pub paused: bool,
    /// Why the pause switch is on, when a reason was given.
    pub pause_reason: Option<String>,
    /// The patterns of the topic pauses in force.
    pub topic_pauses: Vec<String>,
    /// Rows of ordered keys held behind dead letters (zero without per-key ordering that
    /// blocks on dead letters).
    pub held: i64,
    /// Ordered keys with a dead letter holding rows back.
    pub blocked_keys: i64,
    /// Seconds the oldest of the `held` rows has waited.
    pub oldest_held_age_s: Option<i64>,
    /// What per-key ordering holds back of the due rows; `None` without per-key ordering
    /// (or when nothing is due): then no due row is held.
    pub due_held: Option<DueHeld>,
}

/// Decides the verdict, in the order an operator acts on: stuck (nothing moves), paused,
/// blocked (ordered keys behind dead letters), behind, dead letters. Due rows that
/// per-key ordering holds back ([`Inputs::due_held`]) wait by design: only the others
/// count as stuck or behind.
pub fn decide(i: &Inputs, limits: &Limits) -> Verdict {
    let stuck_s = secs(limits.stuck_after);
    let claiming = i
        .relay_last_claims_s
        .iter()
        .any(|s| s.is_some_and(|s| s <= stuck_s as f64));
    let live = i.relay_last_claims_s.len();
    // Rows held by per-key ordering wait by design: they are not stuck.
    let due_free = i.due - i.due_held.map_or(0, |d| d.held);
    // How long the oldest due row that nothing holds has been due.
    let free_due_s = i.due_held.map_or(i.oldest_due_s, |d| d.oldest_free_due_s);
    if let Some(due_s) = free_due_s
        && due_free > 0
        && due_s >= stuck_s
        && !claiming
        && !i.paused
        // Live relays and topic pauses: the due rows may be the paused topics' (below).
        && (i.topic_pauses.is_empty() || live == 0)
    {
        let who = if live == 0 {
            "no relay is alive".to_owned()
        } else if live == 1 {
            "the only live relay has not claimed".to_owned()
        } else {
            format!("none of the {live} live relays has claimed")
        };
        return Verdict {
            state: State::Stuck,
            text: format!(
                "{} due for {due_s} s and {who}",
                counted(due_free, "message")
            ),
        };
    }
    if let Some(due_s) = free_due_s
        && due_free > 0
        && due_s >= stuck_s
        && !i.topic_pauses.is_empty()
        && !claiming
    {
        return Verdict {
            state: State::Paused,
            text: format!(
                "{} due for {due_s} s while topic pauses are in force ({}): the paused topics' rows wait; `outbox resume --topic PATTERN` lifts one",
                counted(due_free, "message"),
                i.topic_pauses.join(", ")
            ),
        };
    }
    if i.paused {
        return Verdict {
            state: State::Paused,
            text: format!(
                "relays are not publishing ({}); `outbox resume` lifts it",
                i.pause_reason.as_deref().unwrap_or("no reason given")
            ),
        };
    }
    if i.held == 0 && i.parked > 0 {
        // Seen without the relays' ordered patterns: the parked rows say it.
        return Verdict {
            state: State::Blocked,
            text: format!(
                "{} parked behind dead letters of their keys (per-key ordering): `outbox dead list --ordered PATTERN` marks the blocking ones; `outbox replay` delivers one first, `outbox dead discard` releases the rest",
                if i.parked == 1 {
                    "1 message is".to_owned()
                } else {
                    format!("{} messages are", group(i.parked))
                }
            ),
        };
    }
    if i.held > 0 {
        return Verdict {
            state: State::Blocked,
            text: format!(
                "{} of {} {} behind dead letters (oldest {}): `outbox dead list --ordered …` marks them BLOCKS; `outbox replay` delivers one first, `outbox dead discard` releases the rest",
                counted(i.held, "message"),
                counted(i.blocked_keys, "ordered key"),
                if i.held == 1 { "waits" } else { "wait" },
                human(i.oldest_held_age_s.unwrap_or(0))
            ),
        };
    }
    // Behind: a row due and not taken for longer than the limit. Rows not due yet (a
    // delayed message, a retry's backoff) are not late, however old.
    if let Some(age) = free_due_s
        && age > secs(limits.max_age)
    {
        return Verdict {
            state: State::Behind,
            text: format!(
                "the oldest due message has waited {} (limit {})",
                human(age),
                human(secs(limits.max_age))
            ),
        };
    }
    if i.dead > limits.max_dead {
        return Verdict {
            state: State::Dead,
            text: format!(
                "{} (limit {}): `outbox dead list` shows them, `outbox replay` puts them back",
                counted(i.dead, "dead letter"),
                limits.max_dead
            ),
        };
    }
    Verdict {
        state: State::Ok,
        text: match i.topic_pauses.len() {
            0 => "OK".into(),
            n => format!(
                "OK ({n} topic pause{} in force: their rows wait)",
                if n == 1 { "" } else { "s" }
            ),
        },
    }
}

/// Whole seconds of `d`, as the database's ages are counted (a duration past i64's range
/// is the largest).
fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

/// `n` (grouped, as [`group`]) and `noun`, plural unless `n` is 1: "1 message",
/// "1,204 messages".
fn counted(n: i64, noun: &str) -> String {
    format!("{} {noun}{}", group(n), if n == 1 { "" } else { "s" })
}

/// 1204 → "1,204".
fn group(n: i64) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `due` rows due, the oldest for `oldest_due` s, and `dead` dead rows.
    fn inputs(due: i64, oldest_due: Option<i64>, dead: i64) -> Inputs {
        Inputs {
            due,
            oldest_due_s: oldest_due,
            dead,
            ..Inputs::default()
        }
    }

    /// One live relay that last claimed `ago` s ago (`None`: never).
    fn with_relay(mut i: Inputs, ago: Option<f64>) -> Inputs {
        i.relay_last_claims_s.push(ago);
        i
    }

    const LIMITS: Limits = Limits {
        max_age: Duration::from_secs(60),
        max_dead: 0,
        stuck_after: Duration::from_secs(30),
    };

    #[test]
    fn states_serialize_and_show_in_upper_case() {
        let v = Verdict {
            state: State::Stuck,
            text: "t".into(),
        };
        assert_eq!(
            serde_json::to_string(&v).unwrap_or_default(),
            r#"{"state":"STUCK","text":"t"}"#
        );
        for s in [
            State::Stuck,
            State::Paused,
            State::Blocked,
            State::Behind,
            State::Dead,
            State::Ok,
        ] {
            assert_eq!(
                serde_json::to_string(&s).unwrap_or_default(),
                format!("\"{s}\"")
            );
        }
        assert!(State::Ok.is_ok() && !State::Dead.is_ok());
    }

    #[test]
    fn parked_rows_block_without_the_ordering_and_do_not_hide_stuck_ones() {
        // Parked rows seen without the ordering: BLOCKED, not OK or DEAD.
        let mut i = inputs(0, None, 1);
        i.parked = 7;
        let v = decide(&i, &LIMITS);
        assert_eq!(v.state, State::Blocked, "{v:?}");
        assert!(v.text.starts_with("7 messages are parked"), "{v:?}");
        // With the ordering, 7 held of which 5 parked: 2 held rows are due; 3 more due
        // rows and no relay: those 3 are stuck.
        let mut i = inputs(5, Some(95), 1);
        i.parked = 5;
        i.held = 7;
        i.blocked_keys = 1;
        i.oldest_held_age_s = Some(95);
        i.due_held = Some(DueHeld {
            held: 2,
            oldest_free_due_s: Some(95),
        });
        let v = decide(&i, &LIMITS);
        assert_eq!(
            (v.state, v.text.as_str()),
            (
                State::Stuck,
                "3 messages due for 95 s and no relay is alive"
            )
        );
    }

    #[test]
    fn verdicts_in_the_order_an_operator_acts_on() {
        let v = decide(&inputs(1204, Some(95), 3), &LIMITS);
        assert_eq!(v.state, State::Stuck);
        assert_eq!(v.text, "1,204 messages due for 95 s and no relay is alive");
        // A relay claimed a moment ago: not stuck, but behind.
        let v = decide(&with_relay(inputs(1204, Some(840), 0), Some(2.0)), &LIMITS);
        assert_eq!(
            (v.state, v.text.as_str()),
            (
                State::Behind,
                "the oldest due message has waited 14 min (limit 60 s)"
            )
        );
        // Nothing due (a message written long ago but delayed): not late.
        let v = decide(&with_relay(inputs(0, None, 0), Some(2.0)), &LIMITS);
        assert_eq!(v.state, State::Ok, "{v:?}");
        // A live relay that has not claimed for long: stuck.
        let v = decide(&with_relay(inputs(5, Some(40), 0), Some(300.0)), &LIMITS);
        assert_eq!(v.state, State::Stuck);
        assert!(
            v.text.ends_with("the only live relay has not claimed"),
            "{v:?}"
        );
        let two = with_relay(with_relay(inputs(5, Some(40), 0), None), Some(300.0));
        let v = decide(&two, &LIMITS);
        assert!(
            v.text.ends_with("none of the 2 live relays has claimed"),
            "{v:?}"
        );
        let topic_paused = |i: Inputs| Inputs {
            topic_pauses: vec!["billing.>".into()],
            ..i
        };
        let v = decide(
            &topic_paused(with_relay(inputs(3, Some(64), 0), None)),
            &LIMITS,
        );
        assert_eq!(v.state, State::Paused, "{v:?}");
        assert!(
            v.text.contains("topic pauses are in force (billing.>)"),
            "{v:?}"
        );
        let v = decide(&topic_paused(inputs(3, Some(64), 0)), &LIMITS);
        assert_eq!(v.state, State::Stuck, "no relay alive at all: {v:?}");
        let v = decide(&inputs(0, None, 10), &LIMITS);
        assert_eq!(v.state, State::Dead);
        assert_eq!(
            v.text,
            "10 dead letters (limit 0): `outbox dead list` shows them, `outbox replay` puts them back"
        );
        let v = decide(&inputs(0, None, 0), &LIMITS);
        assert_eq!((v.state, v.text.as_str()), (State::Ok, "OK"));
        let paused = Inputs {
            paused: true,
            pause_reason: Some("deploy".into()),
            ..inputs(5, Some(400), 0)
        };
        let v = decide(&paused, &LIMITS);
        assert_eq!(
            (v.state, v.text.as_str()),
            (
                State::Paused,
                "relays are not publishing (deploy); `outbox resume` lifts it"
            )
        );
    }

    /// Ordered keys behind dead letters: their rows are due but wait by design, so they
    /// are neither stuck nor merely behind; the verdict names them and the way out.
    #[test]
    fn rows_held_behind_dead_letters_are_blocked_not_stuck() {
        let held = |i: Inputs, due_held: DueHeld| Inputs {
            held: 5,
            blocked_keys: 1,
            oldest_held_age_s: Some(840),
            due_held: Some(due_held),
            ..i
        };
        let all_due_held = DueHeld {
            held: 5,
            oldest_free_due_s: None,
        };
        // Every due row is held, no relay alive: not STUCK.
        let v = decide(&held(inputs(5, Some(840), 1), all_due_held), &LIMITS);
        assert_eq!(v.state, State::Blocked, "{v:?}");
        assert!(
            v.text.starts_with(
                "5 messages of 1 ordered key wait behind dead letters (oldest 14 min)"
            ),
            "{v:?}"
        );
        // Other due rows and no relay: STUCK first, counting only the others.
        let v = decide(
            &held(
                inputs(8, Some(840), 1),
                DueHeld {
                    held: 5,
                    oldest_free_due_s: Some(840),
                },
            ),
            &LIMITS,
        );
        assert_eq!(
            (v.state, v.text.as_str()),
            (
                State::Stuck,
                "3 messages due for 840 s and no relay is alive"
            )
        );
        // A relay claiming: BLOCKED before BEHIND.
        let v = decide(
            &held(with_relay(inputs(5, Some(840), 1), Some(2.0)), all_due_held),
            &LIMITS,
        );
        assert_eq!(v.state, State::Blocked);
    }

    /// Due rows counted as held by per-key ordering (behind a key's first row that is not
    /// due yet) are not stuck; the others still are.
    #[test]
    fn due_rows_held_by_ordering_are_not_stuck() {
        let due_held = |held, oldest_free_due_s| Inputs {
            due_held: Some(DueHeld {
                held,
                oldest_free_due_s,
            }),
            ..inputs(3, Some(95), 0)
        };
        let v = decide(&due_held(3, None), &LIMITS);
        assert_eq!(v.state, State::Ok, "{v:?}");
        // One held, two free due for 12 s (the held one for 95 s): the free ones' age.
        let v = decide(&due_held(1, Some(12)), &LIMITS);
        assert_eq!(
            v.state,
            State::Ok,
            "due for 12 s, not stuck_after (30 s): {v:?}"
        );
        let v = decide(&due_held(1, Some(40)), &LIMITS);
        assert_eq!(
            (v.state, v.text.as_str()),
            (
                State::Stuck,
                "2 messages due for 40 s and no relay is alive"
            )
        );
        // Nor are they a paused topic's rows: with a topic pause in force and a relay
        // alive, held rows alone are no reason to say PAUSED.
        let i = Inputs {
            topic_pauses: vec!["zzz".into()],
            ..with_relay(due_held(3, None), Some(300.0))
        };
        let v = decide(&i, &LIMITS);
        assert_eq!(
            (v.state, v.text.as_str()),
            (State::Ok, "OK (1 topic pause in force: their rows wait)")
        );
        // Held rows are not late either: BEHIND counts the free ones' age.
        let i = Inputs {
            due_held: Some(DueHeld {
                held: 3,
                oldest_free_due_s: None,
            }),
            ..with_relay(inputs(3, Some(900), 0), Some(2.0))
        };
        let v = decide(&i, &LIMITS);
        assert_eq!(v.state, State::Ok, "{v:?}");
    }

    /// Limits past i64's seconds are the largest, not negative: nothing is stuck or late.
    #[test]
    fn huge_limits_do_not_wrap() {
        let huge = Limits {
            max_age: Duration::from_secs(u64::MAX),
            max_dead: 0,
            stuck_after: Duration::from_secs(u64::MAX),
        };
        let v = decide(&inputs(5, Some(900), 0), &huge);
        assert_eq!(v.state, State::Ok, "{v:?}");
    }

    #[test]
    fn numbers_are_grouped_and_ages_human() {
        assert_eq!(group(1_234_567), "1,234,567");
        assert_eq!(group(-1_000), "-1,000");
        assert_eq!(counted(1, "message"), "1 message");
        assert_eq!(human(95), "95 s");
        assert_eq!(human(840), "14 min");
        assert_eq!(human(11_520), "3.2 h");
        assert_eq!(human(172_800), "2.0 d");
    }
}
