//! A model of the outbox protocol, checked by [`stateright`].
//!
//! The model holds the rows of `messages` (their status and attempts, as
//! `docs/state_machine.md` draws them), N relays (claim with a lease and a token, lease
//! renewal, publish in rounds for ordered keys, confirmation, settle fenced by the token,
//! lease expiry, a crash at any step, graceful release, delete on dispatch) and the
//! upkeep and operators beside them (park and unpark of ordered keys behind a dead letter,
//! replay, discard, purge). Every store statement is one atomic step (each is one
//! statement or one short transaction, see `ARCHITECTURE.md`); everything else
//! interleaves freely. Time is abstracted: a pending row is claimable whenever it is not
//! parked (a backoff or a delay only makes the checker try more orders), and a lease ends
//! whenever the model says so, for a live relay (a stall: a pause of the process, a
//! renewal that does not come back) or for a relay that is gone.
//!
//! What the checker explores is bounded: the faults of one run (a crash, a stall, a
//! transient failure, an unavailable destination, a confirmation that never came back, a
//! lost-lease ending, a shutdown) are at most [`Config::faults`], the operator's replays
//! and discards at most [`Config::operations`]. With those bounds every path is finite,
//! which is what lets [`Model::properties`]' liveness property be checked as "eventually"
//! on every path and as a property of every terminal state.
//!
//! Each transition of a row is one of [`TRANSITIONS`], which names the code that enforces
//! it; the tests compare that list with the table of `docs/state_machine.md` and look the
//! named functions up in the source. [`Bug`] seeds a known bug, to show the checker finds
//! it.

use stateright::{Model, Property};

/// A message's place in [`Config::messages`]: also its `id` order.
pub type Msg = usize;

/// What a row of `messages` is in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// Its producer's transaction has not committed yet.
    Uncommitted,
    /// `status = 0`; parked when `available_at = PARKED_AT`.
    Pending {
        /// Held behind a dead letter of its key, out of the claim's due range.
        parked: bool,
    },
    /// `status = 1` under `claim_token = token`.
    Claimed {
        /// The claim's token (a small number in the model).
        token: u8,
        /// The lease ran out: any claim may take the row, the token is fenced out once it does.
        expired: bool,
    },
    /// `status = 2`.
    Dispatched,
    /// `status = 3`, a dead letter.
    Dead,
    /// The row was deleted.
    Deleted(Gone),
}

/// Why a row was deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Gone {
    /// Confirmed and deleted (`--on-dispatch delete`), or dispatched and purged.
    Dispatched,
    /// A dead letter discarded (or purged by dead-row retention) by an operator.
    Discarded,
}

/// A row: its status and its `attempts` column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Row {
    /// The row's status.
    pub status: Status,
    /// The `attempts` column.
    pub attempts: u8,
}

/// A claimed message's outcome as its relay knows it (a confirmation slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Not sent (yet).
    Unsent,
    /// The sink confirmed it.
    Ok,
    /// A transient failure (the sink may or may not hold a copy).
    Transient,
    /// The destination is unavailable: retried with the attempt given back.
    Unavailable,
    /// A permanent failure.
    Permanent,
    /// Claimed past `max_attempts`: quarantined unpublished (`relay::plan`).
    PastMax,
}

/// What a publish of one message brought back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Publish {
    /// The sink took it and confirmed it.
    Confirmed,
    /// The sink refused it for good; it holds no copy.
    Permanent,
    /// A transient failure before the sink took it.
    Transient,
    /// The sink took it but the confirmation never came back (a timeout after sending).
    TakenUnconfirmed,
    /// The destination is unavailable; it holds no copy.
    Unavailable,
}

/// One message of a relay's claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    /// The message.
    pub msg: Msg,
    /// Its attempts as the claim returned them.
    pub attempts: u8,
    /// Its outcome so far.
    pub outcome: Outcome,
}

/// Why a relay stopped waiting for a claim before every message had an outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ending {
    /// Shutdown: what was not confirmed is released (`Ending::Abandoned`).
    Abandoned,
    /// The lease could not be kept (`Ending::LeaseLost`): no outcome, nothing written.
    LeaseLost,
}

/// A relay worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Relay {
    /// Between claims (also: after a crash, restarted).
    Idle,
    /// Holding a claim.
    Holding {
        /// The claim's token.
        token: u8,
        /// The claim's messages in `id` order.
        batch: Vec<Slot>,
        /// Set when the wait ended early.
        ending: Option<Ending>,
    },
}

/// What the checker records about a message beside its row (never read by the protocol).
/// Differences are kept rather than counts, so runs that agree on them are one state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ghost {
    /// The sink confirmed a copy at least once.
    pub confirmed: bool,
    /// The sink took a copy at least once.
    pub taken: bool,
    /// A later message of its key was claimed past it while it was dead
    /// (`--ordered-skip-dead`): a replay of it comes after them, by design.
    pub skipped: bool,
    /// The attempts the row should hold: one per claim since the row was written or
    /// replayed, less one per attempt given back by the claim that held the row.
    pub counted: i8,
    /// Copies the sink may still take without a violation: 1, less each copy taken, plus
    /// one per fault that hit a claim of this message (a crash or a stall of its relay, a
    /// confirmation that never came back).
    pub spare: i8,
}

impl Default for Ghost {
    fn default() -> Self {
        Ghost {
            confirmed: false,
            taken: false,
            skipped: false,
            counted: 0,
            spare: 1,
        }
    }
}

/// Violations seen by a step (what a state predicate cannot see afterwards).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Seen {
    /// A write under a token changed a row another claim holds.
    pub stale_write: bool,
    /// A row was marked dispatched with no confirmation of it.
    pub unconfirmed_mark: bool,
    /// A message was sent while an earlier one of its key was neither confirmed nor dead
    /// and skipped nor discarded.
    pub out_of_order: bool,
    /// A row changed in a way [`TRANSITIONS`] does not declare.
    pub undeclared: bool,
    /// A stale claimant's write was fenced out (non-vacuity).
    pub fenced: bool,
    /// A message was delivered twice (non-vacuity).
    pub duplicate: bool,
    /// A replayed message was dispatched (non-vacuity).
    pub replayed_dispatched: bool,
}

/// The state of the model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// One row per message.
    pub rows: Vec<Row>,
    /// The relays.
    pub relays: Vec<Relay>,
    /// The checker's records per message.
    pub ghosts: Vec<Ghost>,
    /// Per message: replayed at least once.
    pub replayed: Vec<bool>,
    /// The next claim token.
    pub next_token: u8,
    /// Faults left in this run.
    pub faults_left: u8,
    /// Operator replays and discards left in this run.
    pub operations_left: u8,
    /// Violations seen.
    pub seen: Seen,
}

/// A step of the model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The producer's transaction commits.
    Enqueue(Msg),
    /// A relay claims these rows (a bit per message).
    Claim {
        /// The relay.
        relay: usize,
        /// The rows, a bit per message.
        rows: u16,
    },
    /// A relay publishes one message of its claim.
    Publish {
        /// The relay.
        relay: usize,
        /// The message.
        msg: Msg,
        /// What came back.
        outcome: Publish,
    },
    /// A relay settles its claim.
    Settle(usize),
    /// A relay renews its lease.
    Renew(usize),
    /// A relay stops waiting: its renewals failed until the lease would end.
    LeaseLost(usize),
    /// A relay's lease runs out while it lives (a stall).
    Stall(usize),
    /// A relay crashes (and restarts, holding nothing).
    Crash(usize),
    /// A relay shuts down gracefully (and restarts).
    Shutdown(usize),
    /// The lease of a claim whose relay is gone runs out.
    Expire(u8),
    /// `Maintenance::park_held`.
    ParkHeld,
    /// `Maintenance::unpark_released`.
    UnparkReleased,
    /// An operator replays a dead letter.
    Replay(Msg),
    /// An operator discards a dead letter (or dead-row retention purges it).
    Discard(Msg),
    /// Retention purges a dispatched row.
    Purge(Msg),
}

/// A known bug to seed into the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bug {
    /// The settle's `WHERE` checks `status = 1` but not `claim_token`.
    SettleWithoutToken,
    /// The ordered claim ignores the key's earlier rows.
    OrderedClaimIgnoresKey,
    /// The decision marks a message with no outcome dispatched when the wait ends early.
    MarkWithoutOutcome,
}

/// The bounds and settings of one check.
#[derive(Clone, Debug)]
pub struct Config {
    /// Per relay: deletes rows on dispatch (`--on-dispatch delete`) instead of keeping them.
    pub relays: Vec<bool>,
    /// Per message: its key on an ordered topic, or `None` (not ordered).
    pub messages: Vec<Option<u8>>,
    /// `--ordered-skip-dead`: dead letters do not hold their key.
    pub skip_dead: bool,
    /// `max_attempts`.
    pub max_attempts: u8,
    /// The faults of one run.
    pub faults: u8,
    /// The operator's replays and discards of one run.
    pub operations: u8,
    /// A seeded bug.
    pub bug: Option<Bug>,
}

/// The model: [`Config`] as a [`stateright::Model`].
#[derive(Clone, Debug)]
pub struct Outbox(pub Config);

/// Where a transition is enforced: a function in a file, or a text (a `WHERE` guard) in one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// `fn NAME` in the file (a path from the repository's root).
    Fn(&'static str, &'static str),
    /// This text in the file.
    Text(&'static str, &'static str),
}

/// A transition of a row, as `docs/state_machine.md` lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// The model's name for it.
    pub name: &'static str,
    /// The `from` column of the table.
    pub from: &'static str,
    /// The `to` column of the table.
    pub to: &'static str,
    /// A text the table's "enforced by" column holds for this row.
    pub doc: &'static str,
    /// The code that enforces it.
    pub code: &'static [Code],
}

const CLAIM_CODE: &[Code] = &[
    Code::Fn("crates/outbox/src/store/postgres/claim.rs", "claim"),
    Code::Fn(
        "crates/outbox/src/store/postgres/claim.rs",
        "claim_ordered_sql",
    ),
    Code::Fn(
        "crates/outbox/src/store/mysql/claim.rs",
        "claim_ordered_ids",
    ),
    Code::Fn(
        "crates/outbox/src/store/sqlite/claim.rs",
        "claim_ordered_ids",
    ),
    Code::Text(
        "crates/outbox/src/store/postgres/claim.rs",
        "m.status <= 1 AND m.available_at <= now(){lease}{extra}{pauses}",
    ),
];
const SETTLE_CODE: &[Code] = &[
    Code::Fn("crates/outbox/src/store/postgres/settle.rs", "settle"),
    Code::Text(
        "crates/outbox/src/store/postgres/sql/settle.sql",
        "claim_token = $9 AND status <= 1",
    ),
    Code::Fn("crates/outbox/src/store/mysql/settle.rs", "settle_once"),
    Code::Text(
        "crates/outbox/src/store/mysql/settle.rs",
        "WHERE m.claim_token = '{token_text}' AND m.status = 1",
    ),
    Code::Fn("crates/outbox/src/store/sqlite/settle.rs", "settle"),
    Code::Text(
        "crates/outbox/src/store/sqlite/mod.rs",
        "m.claim_token = ?2 AND m.status <= 1",
    ),
    Code::Fn("crates/outbox/src/relay/decide.rs", "decide"),
];

/// Every transition of a row the model makes, with the code that enforces it. The names
/// are the model's; `from`/`to` are the words of `docs/state_machine.md`'s table.
pub const TRANSITIONS: &[Transition] = &[
    Transition {
        name: "enqueue",
        from: "—",
        to: "pending",
        doc: "unique index on `message_id`",
        code: &[
            Code::Fn("crates/outbox/src/store/postgres/enqueue.rs", "enqueue"),
            Code::Fn("crates/outbox/src/store/mysql/enqueue.rs", "enqueue"),
            Code::Fn("crates/outbox/src/store/sqlite/enqueue.rs", "enqueue"),
        ],
    },
    Transition {
        name: "claim",
        from: "pending (due)",
        to: "claimed",
        doc: "`Relaying::claim`",
        code: CLAIM_CODE,
    },
    Transition {
        name: "claim an expired claim",
        from: "claimed (expired)",
        to: "claimed",
        doc: "the same claim statement",
        code: CLAIM_CODE,
    },
    Transition {
        name: "renew",
        from: "claimed",
        to: "claimed",
        doc: "`Relaying::renew`, guarded by the token",
        code: &[
            Code::Fn("crates/outbox/src/store/postgres/settle.rs", "renew"),
            Code::Text(
                "crates/outbox/src/store/postgres/sql/renew.sql",
                "claim_token = $1 AND status <= 1",
            ),
            Code::Fn("crates/outbox/src/relay/process.rs", "keep_lease"),
        ],
    },
    Transition {
        name: "settle: dispatched",
        from: "claimed",
        to: "dispatched",
        doc: "`Settlement::dispatched`), guarded by `claim_token` on a live row",
        code: SETTLE_CODE,
    },
    Transition {
        name: "settle: delete on dispatch",
        from: "claimed",
        to: "(deleted)",
        doc: "`Relaying::delete_claimed`",
        code: &[
            Code::Fn("crates/outbox/src/store/mod.rs", "settle_deleting"),
            Code::Fn(
                "crates/outbox/src/store/postgres/settle.rs",
                "delete_claimed",
            ),
            Code::Text(
                "crates/outbox/src/store/postgres/sql/delete_claimed.sql",
                "claim_token = $2 AND status <= 1",
            ),
            Code::Fn(
                "crates/outbox/src/store/mysql/settle.rs",
                "delete_claimed_once",
            ),
            Code::Fn("crates/outbox/src/store/sqlite/settle.rs", "delete_claimed"),
        ],
    },
    Transition {
        name: "settle: retry",
        from: "claimed",
        to: "pending (scheduled)",
        doc: "`Settlement::retries`",
        code: SETTLE_CODE,
    },
    Transition {
        name: "settle: dead",
        from: "claimed",
        to: "dead",
        doc: "`Settlement::dead`",
        code: SETTLE_CODE,
    },
    Transition {
        name: "settle: release",
        from: "claimed",
        to: "pending (due)",
        doc: "`Settlement::release`",
        code: SETTLE_CODE,
    },
    Transition {
        name: "park_held",
        from: "pending (due)",
        to: "pending (parked)",
        doc: "`Maintenance::park_held`",
        code: &[
            Code::Fn("crates/outbox/src/store/postgres/ordering.rs", "park_held"),
            Code::Fn("crates/outbox/src/store/sqlite/ordering.rs", "park_held"),
            Code::Fn("crates/outbox/src/store/mysql/schema.rs", "park_held"),
        ],
    },
    Transition {
        name: "unpark",
        from: "pending (parked)",
        to: "pending (due)",
        doc: "`Maintenance::unpark_released`",
        code: &[
            Code::Fn(
                "crates/outbox/src/store/postgres/ordering.rs",
                "unpark_released",
            ),
            Code::Fn(
                "crates/outbox/src/store/postgres/ordering.rs",
                "unpark_keys",
            ),
            Code::Fn(
                "crates/outbox/src/store/sqlite/ordering.rs",
                "unpark_released",
            ),
            Code::Fn("crates/outbox/src/store/common/replay.rs", "replay"),
        ],
    },
    Transition {
        name: "replay",
        from: "dead",
        to: "pending",
        doc: "`Operations::replay`: only rows that are dead change",
        code: &[
            Code::Fn("crates/outbox/src/store/common/replay.rs", "replay"),
            Code::Fn("crates/outbox/src/store/postgres/ops.rs", "replay"),
            Code::Fn("crates/outbox/src/store/mysql/ops.rs", "replay"),
            Code::Fn("crates/outbox/src/store/sqlite/ops.rs", "replay"),
        ],
    },
    Transition {
        name: "discard",
        from: "dead",
        to: "(deleted)",
        doc: "`Operations::replay` with `Discard`/`Purge`",
        code: &[Code::Fn(
            "crates/outbox/src/store/common/replay.rs",
            "replay",
        )],
    },
    Transition {
        name: "purge",
        from: "dispatched",
        to: "(deleted)",
        doc: "`Maintenance::purge`",
        code: &[
            Code::Fn("crates/outbox/src/store/postgres/schema.rs", "purge"),
            Code::Fn("crates/outbox/src/store/mysql/schema.rs", "purge"),
            Code::Fn("crates/outbox/src/store/sqlite/schema.rs", "purge"),
        ],
    },
];

/// The table's word for a row's status in the model.
fn class(s: Status) -> &'static str {
    match s {
        Status::Uncommitted => "—",
        Status::Pending { parked: false } => "pending (due)",
        Status::Pending { parked: true } => "pending (parked)",
        Status::Claimed { expired: true, .. } => "claimed (expired)",
        Status::Claimed { .. } => "claimed",
        Status::Dispatched => "dispatched",
        Status::Dead => "dead",
        Status::Deleted(_) => "(deleted)",
    }
}

/// True when the table's word `word` covers the model's class `c` (time is abstracted: a
/// scheduled row is a due one, and "claimed" covers an expired claim).
fn covers(word: &str, c: &str) -> bool {
    word == c
        || (word == "pending" && c == "pending (due)")
        || (word == "pending (scheduled)" && c == "pending (due)")
        || (word == "claimed" && c == "claimed (expired)")
}

/// The transition named `name`.
fn transition(name: &str) -> Option<&'static Transition> {
    TRANSITIONS.iter().find(|t| t.name == name)
}

impl State {
    /// Renumbers the claim tokens in order of appearance (rows, then relays): two states
    /// that differ only in the tokens' numbers are one state to the checker.
    fn canonical_tokens(&mut self) {
        let mut seen: Vec<u8> = Vec::new();
        let mut map = |t: u8| -> u8 {
            let i = seen.iter().position(|&x| x == t).unwrap_or_else(|| {
                seen.push(t);
                seen.len() - 1
            });
            u8::try_from(i).unwrap_or(u8::MAX)
        };
        for r in &mut self.rows {
            if let Status::Claimed { token, .. } = &mut r.status {
                *token = map(*token);
            }
        }
        for r in &mut self.relays {
            if let Relay::Holding { token, .. } = r {
                *token = map(*token);
            }
        }
        self.next_token = u8::try_from(seen.len()).unwrap_or(u8::MAX);
    }

    /// Moves `m` to `to` by the transition `name`; records a violation when the
    /// transition is not declared or does not start or end where it says.
    fn set(&mut self, m: Msg, to: Status, name: &str) {
        let from = self.rows[m].status;
        let ok = transition(name)
            .is_some_and(|t| covers(t.from, class(from)) && covers(t.to, class(to)));
        if !ok {
            self.seen.undeclared = true;
        }
        self.rows[m].status = to;
    }
}

impl Outbox {
    fn key(&self, m: Msg) -> Option<u8> {
        self.0.messages[m]
    }

    /// The earlier messages of `m`'s key.
    fn earlier(&self, m: Msg) -> impl Iterator<Item = Msg> + '_ {
        let key = self.key(m);
        (0..m).filter(move |&e| key.is_some() && self.key(e) == key)
    }

    /// True when an earlier row of `m`'s key is dead.
    fn behind_dead(&self, s: &State, m: Msg) -> bool {
        self.earlier(m).any(|e| s.rows[e].status == Status::Dead)
    }

    /// True when `e`, earlier in its key than a message, lets the claim take that message
    /// without taking `e` too: `e` is dispatched or deleted, or dead and skipped.
    fn lets_pass(&self, s: &State, e: Msg) -> bool {
        match s.rows[e].status {
            Status::Dispatched | Status::Deleted(_) => true,
            Status::Dead => self.0.skip_dead,
            _ => false,
        }
    }

    /// True when slot `i` of a batch is held: its key is stopped (by a message of the key
    /// claimed past `max_attempts`, with strict ordering: `DeadStops`; by an earlier
    /// message of the key in this claim that was sent without an `Ok`: `KeyStops`).
    fn held(&self, batch: &[Slot], i: usize) -> bool {
        let Some(key) = self.key(batch[i].msg) else {
            return false;
        };
        let same = |s: &&Slot| self.key(s.msg) == Some(key);
        if !self.0.skip_dead
            && batch
                .iter()
                .filter(same)
                .any(|s| s.outcome == Outcome::PastMax)
        {
            return true;
        }
        batch[..i]
            .iter()
            .filter(same)
            .any(|s| !matches!(s.outcome, Outcome::Ok | Outcome::Unsent | Outcome::PastMax))
    }

    /// True when slot `i` may be sent now: unsent, not held, and every earlier message of
    /// its key in the claim confirmed (the rounds of `relay::rounds`).
    fn sendable(&self, batch: &[Slot], i: usize) -> bool {
        if batch[i].outcome != Outcome::Unsent || self.held(batch, i) {
            return false;
        }
        let key = self.key(batch[i].msg);
        key.is_none()
            || batch[..i]
                .iter()
                .filter(|s| self.key(s.msg) == key)
                .all(|s| matches!(s.outcome, Outcome::Ok | Outcome::PastMax))
    }

    /// True when `rows` (a bit per message) is a claim the claim statement may return.
    fn claimable(&self, s: &State, rows: u16) -> bool {
        let n = self.0.messages.len();
        for m in 0..n {
            if rows & (1 << m) == 0 {
                continue;
            }
            match s.rows[m].status {
                Status::Pending { parked: false } | Status::Claimed { expired: true, .. } => {}
                _ => return false,
            }
            if self.0.bug == Some(Bug::OrderedClaimIgnoresKey) {
                continue;
            }
            // Per-key order: every earlier row of the key is dispatched (or deleted), dead
            // and skipped, or in this claim.
            if !self
                .earlier(m)
                .all(|e| rows & (1 << e) != 0 || self.lets_pass(s, e))
            {
                return false;
            }
        }
        true
    }

    /// True when nothing remains to be done for `m`: dispatched, dead, discarded, or
    /// waiting behind a dead letter of its key (strict ordering: the operator's to release).
    fn settled(&self, s: &State, m: Msg) -> bool {
        match s.rows[m].status {
            Status::Dispatched | Status::Dead | Status::Deleted(_) => true,
            // A claim whose lease ran out behind a dead letter waits there too: no claim
            // takes it (its key's head is dead) and `park_held` parks only pending rows.
            Status::Pending { .. } | Status::Claimed { expired: true, .. } => {
                !self.0.skip_dead && self.behind_dead(s, m)
            }
            _ => false,
        }
    }

    fn terminal(&self, s: &State) -> bool {
        let mut a = Vec::new();
        self.actions(s, &mut a);
        a.is_empty()
    }

    fn holder(s: &State, token: u8) -> bool {
        s.relays
            .iter()
            .any(|r| matches!(r, Relay::Holding { token: t, .. } if *t == token))
    }

    /// Gives the parked rows of `m`'s key after `m` back, up to the key's next dead letter
    /// (`unpark_keys`, in replay's transaction).
    fn unpark_after(&self, s: &mut State, m: Msg) {
        let key = self.key(m);
        if key.is_none() {
            return;
        }
        for f in m + 1..self.0.messages.len() {
            if self.key(f) == key
                && s.rows[f].status == (Status::Pending { parked: true })
                && !self.behind_dead(s, f)
            {
                s.set(f, Status::Pending { parked: false }, "unpark");
            }
        }
    }

    /// The relay's settle: `relay::decide`, then `Relaying::settle` (fenced by the token).
    fn settle(&self, s: &mut State, relay: usize) {
        let Relay::Holding {
            token,
            batch,
            ending,
        } = s.relays[relay].clone()
        else {
            return;
        };
        let delete = self.0.relays[relay];
        for (i, slot) in batch.iter().enumerate() {
            let m = slot.msg;
            let unsent = slot.outcome == Outcome::Unsent;
            let held = unsent && (self.held(&batch, i) || ending == Some(Ending::Abandoned));
            // relay::decide
            let (to, name, give_back) = match slot.outcome {
                _ if held && ending == Some(Ending::LeaseLost) => continue,
                _ if held => (Status::Pending { parked: false }, "settle: release", true),
                Outcome::Unsent => {
                    if self.0.bug == Some(Bug::MarkWithoutOutcome) {
                        (Status::Dispatched, "settle: dispatched", false)
                    } else {
                        continue; // the lease was lost: nothing written
                    }
                }
                Outcome::Ok if delete => (
                    Status::Deleted(Gone::Dispatched),
                    "settle: delete on dispatch",
                    false,
                ),
                Outcome::Ok => (Status::Dispatched, "settle: dispatched", false),
                Outcome::Unavailable => (Status::Pending { parked: false }, "settle: retry", true),
                Outcome::Transient if slot.attempts < self.0.max_attempts => {
                    (Status::Pending { parked: false }, "settle: retry", false)
                }
                Outcome::Transient | Outcome::Permanent | Outcome::PastMax => {
                    (Status::Dead, "settle: dead", false)
                }
            };
            // The fence: `claim_token = token AND status = 1`.
            let Status::Claimed { token: now, .. } = s.rows[m].status else {
                s.seen.fenced = true;
                continue;
            };
            if now != token {
                if self.0.bug != Some(Bug::SettleWithoutToken) {
                    s.seen.fenced = true;
                    continue;
                }
                s.seen.stale_write = true;
            }
            if matches!(to, Status::Dispatched | Status::Deleted(Gone::Dispatched)) {
                if !s.ghosts[m].confirmed {
                    s.seen.unconfirmed_mark = true;
                }
                if s.replayed[m] {
                    s.seen.replayed_dispatched = true;
                }
            }
            if give_back {
                s.rows[m].attempts = s.rows[m].attempts.saturating_sub(1);
                if now == token {
                    s.ghosts[m].counted -= 1;
                }
            }
            s.set(m, to, name);
        }
        s.relays[relay] = Relay::Idle;
    }
}

impl Model for Outbox {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let n = self.0.messages.len();
        vec![State {
            rows: vec![
                Row {
                    status: Status::Uncommitted,
                    attempts: 0
                };
                n
            ],
            relays: vec![Relay::Idle; self.0.relays.len()],
            ghosts: vec![Ghost::default(); n],
            replayed: vec![false; n],
            next_token: 0,
            faults_left: self.0.faults,
            operations_left: self.0.operations,
            seen: Seen::default(),
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        let n = self.0.messages.len();
        let fault = s.faults_left > 0;
        for m in 0..n {
            match s.rows[m].status {
                // Producers commit in id order: one key's must (the user guide's rule);
                // across keys it only spares interleavings that claims of any subset of
                // the rows already cover.
                Status::Uncommitted if (0..m).all(|e| s.rows[e].status != Status::Uncommitted) => {
                    out.push(Action::Enqueue(m));
                }
                Status::Dead if s.operations_left > 0 => {
                    out.push(Action::Replay(m));
                    out.push(Action::Discard(m));
                }
                // Purge commutes with every other step (nothing tells a dispatched row from
                // a deleted one but the row itself), so where it happens changes nothing
                // else: the checker tries it only while every relay is idle.
                Status::Dispatched if s.relays.iter().all(|r| *r == Relay::Idle) => {
                    out.push(Action::Purge(m));
                }
                Status::Claimed {
                    token,
                    expired: false,
                } if !Self::holder(s, token) && !out.contains(&Action::Expire(token)) => {
                    out.push(Action::Expire(token));
                }
                _ => {}
            }
        }
        if !self.0.skip_dead
            && (0..n).any(|m| {
                s.rows[m].status == (Status::Pending { parked: false }) && self.behind_dead(s, m)
            })
        {
            out.push(Action::ParkHeld);
        }
        if (0..n).any(|m| {
            s.rows[m].status == (Status::Pending { parked: true })
                && (self.0.skip_dead || !self.behind_dead(s, m))
        }) {
            out.push(Action::UnparkReleased);
        }
        for (r, relay) in s.relays.iter().enumerate() {
            match relay {
                Relay::Idle => {
                    for rows in 1..(1u16 << n) {
                        if self.claimable(s, rows) {
                            out.push(Action::Claim { relay: r, rows });
                        }
                    }
                }
                Relay::Holding {
                    token,
                    batch,
                    ending,
                } => {
                    let mine = |m: Msg| matches!(s.rows[m].status, Status::Claimed { token: t, .. } if t == *token);
                    let expired = |m: Msg| {
                        s.rows[m].status
                            == (Status::Claimed {
                                token: *token,
                                expired: true,
                            })
                    };
                    if ending.is_none() {
                        for (i, slot) in batch.iter().enumerate() {
                            if self.sendable(batch, i) {
                                let m = slot.msg;
                                out.push(Action::Publish {
                                    relay: r,
                                    msg: m,
                                    outcome: Publish::Confirmed,
                                });
                                out.push(Action::Publish {
                                    relay: r,
                                    msg: m,
                                    outcome: Publish::Permanent,
                                });
                                if fault {
                                    out.push(Action::Publish {
                                        relay: r,
                                        msg: m,
                                        outcome: Publish::Transient,
                                    });
                                    out.push(Action::Publish {
                                        relay: r,
                                        msg: m,
                                        outcome: Publish::TakenUnconfirmed,
                                    });
                                    out.push(Action::Publish {
                                        relay: r,
                                        msg: m,
                                        outcome: Publish::Unavailable,
                                    });
                                }
                            }
                        }
                        let lost_all = batch.iter().all(|sl| !mine(sl.msg));
                        if lost_all || batch.iter().any(|sl| expired(sl.msg)) {
                            out.push(Action::Renew(r));
                        }
                        if fault {
                            out.push(Action::LeaseLost(r));
                            out.push(Action::Shutdown(r));
                            if batch.iter().any(|sl| {
                                s.rows[sl.msg].status
                                    == (Status::Claimed {
                                        token: *token,
                                        expired: false,
                                    })
                            }) {
                                out.push(Action::Stall(r));
                            }
                        }
                    }
                    let done = batch
                        .iter()
                        .enumerate()
                        .all(|(i, sl)| sl.outcome != Outcome::Unsent || self.held(batch, i));
                    if ending.is_some() || done {
                        out.push(Action::Settle(r));
                    }
                    if fault {
                        out.push(Action::Crash(r));
                    }
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        let n = self.0.messages.len();
        match action {
            Action::Enqueue(m) => {
                s.rows[m].attempts = 0;
                s.set(m, Status::Pending { parked: false }, "enqueue");
            }
            Action::Claim { relay, rows } => {
                let token = s.next_token;
                s.next_token = s.next_token.wrapping_add(1);
                let mut batch = Vec::new();
                for m in (0..n).filter(|m| rows & (1 << m) != 0) {
                    let name = match s.rows[m].status {
                        Status::Claimed { .. } => "claim an expired claim",
                        _ => "claim",
                    };
                    s.rows[m].attempts += 1;
                    s.ghosts[m].counted += 1;
                    for e in self.earlier(m) {
                        if s.rows[e].status == Status::Dead {
                            s.ghosts[e].skipped = true;
                        }
                    }
                    s.set(
                        m,
                        Status::Claimed {
                            token,
                            expired: false,
                        },
                        name,
                    );
                    let attempts = s.rows[m].attempts;
                    let outcome = if attempts > self.0.max_attempts {
                        Outcome::PastMax
                    } else {
                        Outcome::Unsent
                    };
                    batch.push(Slot {
                        msg: m,
                        attempts,
                        outcome,
                    });
                }
                s.relays[relay] = Relay::Holding {
                    token,
                    batch,
                    ending: None,
                };
            }
            Action::Publish {
                relay,
                msg,
                outcome,
            } => {
                // Per-key order, as the sink sees it.
                if self.earlier(msg).any(|e| {
                    !(s.ghosts[e].confirmed
                        || s.rows[e].status == Status::Deleted(Gone::Discarded)
                        || (self.0.skip_dead
                            && (s.rows[e].status == Status::Dead || s.ghosts[e].skipped)))
                }) {
                    s.seen.out_of_order = true;
                }
                let g = &mut s.ghosts[msg];
                if g.taken && matches!(outcome, Publish::Confirmed | Publish::TakenUnconfirmed) {
                    s.seen.duplicate = true;
                }
                let result = match outcome {
                    Publish::Confirmed => {
                        g.spare -= 1;
                        g.taken = true;
                        g.confirmed = true;
                        Outcome::Ok
                    }
                    Publish::Permanent => Outcome::Permanent,
                    Publish::Transient => Outcome::Transient,
                    Publish::TakenUnconfirmed => {
                        // The copy taken is paid for by the confirmation it lost.
                        g.taken = true;
                        Outcome::Transient
                    }
                    Publish::Unavailable => Outcome::Unavailable,
                };
                if !matches!(outcome, Publish::Confirmed | Publish::Permanent) {
                    s.faults_left -= 1;
                }
                if let Relay::Holding { batch, .. } = &mut s.relays[relay] {
                    for slot in batch.iter_mut().filter(|sl| sl.msg == msg) {
                        slot.outcome = result;
                    }
                }
            }
            Action::Settle(relay) => self.settle(&mut s, relay),
            Action::Renew(relay) => {
                let Relay::Holding {
                    token,
                    batch,
                    ending,
                } = &mut s.relays[relay]
                else {
                    return None;
                };
                let token = *token;
                let mut held = false;
                for sl in batch.iter() {
                    if let Status::Claimed { token: t, .. } = s.rows[sl.msg].status
                        && t == token
                    {
                        held = true;
                    }
                }
                if !held {
                    *ending = Some(Ending::LeaseLost); // every row lost
                }
                let ids: Vec<Msg> = batch.iter().map(|sl| sl.msg).collect();
                for m in ids {
                    if let Status::Claimed { token: t, .. } = s.rows[m].status
                        && t == token
                    {
                        s.set(
                            m,
                            Status::Claimed {
                                token,
                                expired: false,
                            },
                            "renew",
                        );
                    }
                }
            }
            Action::LeaseLost(relay) => {
                s.faults_left -= 1;
                if let Relay::Holding { ending, .. } = &mut s.relays[relay] {
                    *ending = Some(Ending::LeaseLost);
                }
            }
            Action::Stall(relay) => {
                s.faults_left -= 1;
                let Relay::Holding { token, batch, .. } = &s.relays[relay] else {
                    return None;
                };
                let token = *token;
                for sl in batch.clone() {
                    if s.rows[sl.msg].status
                        == (Status::Claimed {
                            token,
                            expired: false,
                        })
                    {
                        s.rows[sl.msg].status = Status::Claimed {
                            token,
                            expired: true,
                        };
                        s.ghosts[sl.msg].spare += 1;
                    }
                }
            }
            Action::Crash(relay) => {
                s.faults_left -= 1;
                if let Relay::Holding { batch, .. } = &s.relays[relay] {
                    for sl in batch.clone() {
                        s.ghosts[sl.msg].spare += 1;
                    }
                }
                s.relays[relay] = Relay::Idle;
            }
            Action::Shutdown(relay) => {
                s.faults_left -= 1;
                if let Relay::Holding { ending, .. } = &mut s.relays[relay] {
                    *ending = Some(Ending::Abandoned);
                }
            }
            Action::Expire(token) => {
                for m in 0..n {
                    if s.rows[m].status
                        == (Status::Claimed {
                            token,
                            expired: false,
                        })
                    {
                        s.rows[m].status = Status::Claimed {
                            token,
                            expired: true,
                        };
                    }
                }
            }
            Action::ParkHeld => {
                for m in 0..n {
                    if s.rows[m].status == (Status::Pending { parked: false })
                        && self.behind_dead(&s, m)
                    {
                        s.set(m, Status::Pending { parked: true }, "park_held");
                    }
                }
            }
            Action::UnparkReleased => {
                for m in 0..n {
                    if s.rows[m].status == (Status::Pending { parked: true })
                        && (self.0.skip_dead || !self.behind_dead(&s, m))
                    {
                        s.set(m, Status::Pending { parked: false }, "unpark");
                    }
                }
            }
            Action::Replay(m) => {
                s.operations_left -= 1;
                s.rows[m].attempts = 0;
                s.ghosts[m].counted = 0;
                s.replayed[m] = true;
                s.set(m, Status::Pending { parked: false }, "replay");
                self.unpark_after(&mut s, m);
            }
            Action::Discard(m) => {
                s.operations_left -= 1;
                s.set(m, Status::Deleted(Gone::Discarded), "discard");
                self.unpark_after(&mut s, m);
            }
            Action::Purge(m) => s.set(m, Status::Deleted(Gone::Dispatched), "purge"),
        }
        s.canonical_tokens();
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "no message is marked dispatched without a confirmation of it",
                |_: &Outbox, s: &State| {
                    !s.seen.unconfirmed_mark
                        && s.rows.iter().zip(&s.ghosts).all(|(r, g)| {
                            !matches!(
                                r.status,
                                Status::Dispatched | Status::Deleted(Gone::Dispatched)
                            ) || g.confirmed
                        })
                },
            ),
            Property::always(
                "a stale claimant changes nothing",
                |_: &Outbox, s: &State| !s.seen.stale_write,
            ),
            Property::always(
                "attempts are counted once per claim and given back on release",
                |_: &Outbox, s: &State| {
                    s.rows.iter().zip(&s.ghosts).all(|(r, g)| {
                        matches!(r.status, Status::Uncommitted | Status::Deleted(_))
                            || i32::from(r.attempts) == i32::from(g.counted)
                    })
                },
            ),
            Property::always(
                "no message of an ordered key is published before an earlier one is confirmed, skipped dead or discarded",
                |_: &Outbox, s: &State| !s.seen.out_of_order,
            ),
            Property::always(
                "a message is published again only after a crash, a stall or a lost confirmation",
                |_: &Outbox, s: &State| s.ghosts.iter().all(|g| g.spare >= 0),
            ),
            Property::always(
                "every row change is a declared transition",
                |_: &Outbox, s: &State| !s.seen.undeclared,
            ),
            Property::always(
                "no committed message is lost: a final state has every message settled",
                |m: &Outbox, s: &State| {
                    !m.terminal(s) || (0..s.rows.len()).all(|i| m.settled(s, i))
                },
            ),
            Property::eventually(
                "every committed message is eventually dispatched, dead, discarded or behind a dead letter",
                |m: &Outbox, s: &State| (0..s.rows.len()).all(|i| m.settled(s, i)),
            ),
            Property::sometimes("a message is delivered twice", |_: &Outbox, s: &State| {
                s.seen.duplicate
            }),
            Property::sometimes("a stale claimant is fenced out", |_: &Outbox, s: &State| {
                s.seen.fenced
            }),
            Property::sometimes("a row is deleted on dispatch", |_: &Outbox, s: &State| {
                s.rows
                    .iter()
                    .any(|r| r.status == Status::Deleted(Gone::Dispatched))
            }),
            Property::sometimes(
                "a replayed message is dispatched",
                |_: &Outbox, s: &State| s.seen.replayed_dispatched,
            ),
        ]
    }
}

impl State {
    /// The rows in one line: `m0 claimed(t1) a1 | m1 pending | …`.
    pub fn rows_line(&self) -> String {
        self.rows
            .iter()
            .enumerate()
            .map(|(m, r)| {
                let st = match r.status {
                    Status::Uncommitted => "uncommitted".to_owned(),
                    Status::Pending { parked: false } => "pending".to_owned(),
                    Status::Pending { parked: true } => "pending(parked)".to_owned(),
                    Status::Claimed { token, expired } => {
                        format!(
                            "claimed(t{token}{})",
                            if expired { ", expired" } else { "" }
                        )
                    }
                    Status::Dispatched => "dispatched".to_owned(),
                    Status::Dead => "dead".to_owned(),
                    Status::Deleted(g) => format!("deleted({g:?})"),
                };
                format!("m{m} {st} a{}", r.attempts)
            })
            .collect::<Vec<_>>()
            .join(" | ")
    }
}

/// A counterexample (or example) path as text: each step's action and the rows after it.
pub fn render(path: &stateright::Path<State, Action>) -> String {
    let states = path.clone().into_states();
    let actions = path.clone().into_actions();
    let mut out = format!(
        "   start: {}\n",
        states.first().map(State::rows_line).unwrap_or_default()
    );
    for (i, a) in actions.iter().enumerate() {
        let after = states.get(i + 1).map(State::rows_line).unwrap_or_default();
        out.push_str(&format!("{:>3}. {a:?}\n       → {after}\n", i + 1));
    }
    out
}
