//! Per-key ordering within one claim, pure: the rounds in which its messages go out
//! ([`rounds`]), a key's messages one after another, different keys together, and the
//! rules that stop a key ([`DeadStops`] before the first round, [`KeyStops`] from round
//! to round).

use super::Policy;
use crate::message::OutgoingMessage;
use crate::store::{Dead, KeyOrdering};

/// The rounds in which a claim is published: `of[r]` lists indices into `messages` (in
/// `id` order, as claimed), published together, round `r + 1` only once round `r` has its
/// outcomes. A message of an ordered topic with a key is in the round after the previous
/// message of its key in this claim; every other message is in round 0. So a key's
/// messages go out one at a time in `id` order while different keys go together; without
/// ordering (or with no key twice) there is one round.
#[derive(Debug, PartialEq)]
pub(crate) struct Rounds {
    /// The rounds, each a list of indices into the claim's messages.
    pub(crate) of: Vec<Vec<usize>>,
    /// Per message, its ordered key's number in this claim (0, 1, …, in order of first
    /// appearance); `None` for a message that is not ordered.
    pub(crate) key: Vec<Option<usize>>,
    /// How many ordered keys the claim holds.
    pub(crate) keys: usize,
}

/// The [`Rounds`] of a claim's `messages` under `ordering`.
pub(crate) fn rounds(messages: &[OutgoingMessage], ordering: &KeyOrdering) -> Rounds {
    let mut rounds = Rounds {
        of: vec![Vec::new()],
        key: vec![None; messages.len()],
        keys: 0,
    };
    if !ordering.is_on() {
        rounds.of[0].extend(0..messages.len());
        return rounds;
    }
    // Per ordered key: its number and the round of its next message.
    let mut next: std::collections::HashMap<(&str, &str), (usize, usize)> = Default::default();
    for (i, m) in messages.iter().enumerate() {
        let r = match m.key.as_deref() {
            Some(key) if ordering.covers(&m.topic) => {
                let fresh = next.len();
                let (k, r) = next.entry((m.topic.as_str(), key)).or_insert((fresh, 0));
                rounds.key[i] = Some(*k);
                *r += 1;
                *r - 1
            }
            _ => 0,
        };
        if rounds.of.len() <= r {
            rounds.of.resize_with(r + 1, Vec::new);
        }
        rounds.of[r].push(i);
    }
    rounds.keys = next.len();
    rounds
}

/// What the messages of a claim that go dead unpublished stop, with strict per-key
/// ordering (dead rows hold their key back): one past `max_attempts` stops its key
/// (`keys`), a malformed row, whose key is not known, every message after it (`after`:
/// by id, so a message of a topic that is not ordered is held too). Without strict
/// ordering, nothing.
#[derive(Debug, PartialEq)]
pub(crate) struct DeadStops {
    /// No message with this id or a later one is published: the first malformed row's id
    /// (`i64::MAX`: none).
    pub(crate) after: i64,
    /// (topic, key) of each message past `max_attempts` on an ordered topic.
    pub(crate) keys: Vec<(String, Option<String>)>,
}

impl DeadStops {
    /// The stops of a claim's `messages` (all of them, before [`plan`](super::plan)) and
    /// its `malformed` rows under `ordering` and `policy`.
    pub(crate) fn of(
        messages: &[OutgoingMessage],
        malformed: &[Dead],
        ordering: &KeyOrdering,
        policy: &Policy,
    ) -> Self {
        let strict = ordering.holds_dead();
        let after = if strict {
            malformed.iter().map(|d| d.id).min().unwrap_or(i64::MAX)
        } else {
            i64::MAX
        };
        let keys: Vec<(String, Option<String>)> = if strict {
            messages
                .iter()
                .filter(|m| m.attempts > policy.max_attempts && ordering.covers(&m.topic))
                .map(|m| (m.topic.clone(), m.key.clone()))
                .collect()
        } else {
            Vec::new()
        };
        DeadStops { after, keys }
    }

    /// True when they stop nothing: then a claim in one round goes out as one publish.
    pub(crate) fn is_empty(&self) -> bool {
        self.keys.is_empty() && self.after == i64::MAX
    }
}

/// The ordered-key stop rules while a claim is published in [`Rounds`]: which messages of
/// a round still go out. A message goes out when its id is before [`DeadStops::after`]
/// and its ordered key (if any) is not stopped; a key stops when a message of it went
/// dead unpublished ([`DeadStops::keys`]), and when one of its messages was sent without
/// an `Ok` (its later messages of the claim are held, then released).
#[derive(Debug, PartialEq)]
pub(crate) struct KeyStops {
    /// As [`DeadStops::after`].
    pub(crate) after: i64,
    /// Per ordered key of the claim (numbered as in [`Rounds::key`]): true once it must
    /// not be published further.
    pub(crate) stopped: Vec<bool>,
}

impl KeyStops {
    /// The stops before the first round: the keys of `dead` stopped among the ordered
    /// keys of `messages` (the claim's messages to publish, as [`plan`](super::plan) left
    /// them) in `rounds`.
    pub(crate) fn at_claim(
        dead: &DeadStops,
        messages: &[OutgoingMessage],
        rounds: &Rounds,
    ) -> Self {
        let mut stopped = vec![false; rounds.keys];
        for (m, k) in messages.iter().zip(&rounds.key) {
            if let Some(k) = k
                && dead
                    .keys
                    .iter()
                    .any(|(t, key)| *t == m.topic && *key == m.key)
            {
                stopped[*k] = true;
            }
        }
        KeyStops {
            after: dead.after,
            stopped,
        }
    }

    /// The messages of `round` (indices into `messages`) that go out now: those before
    /// `after` whose ordered key is not stopped, in the round's order.
    pub(crate) fn pick(
        &self,
        round: &[usize],
        messages: &[OutgoingMessage],
        rounds: &Rounds,
    ) -> Vec<usize> {
        round
            .iter()
            .copied()
            .filter(|&i| {
                messages[i].id < self.after && rounds.key[i].is_none_or(|k| !self.stopped[k])
            })
            .collect()
    }

    /// After a round that sent `sent`: stops the ordered key of each message whose
    /// outcome is not `Ok` (`confirmed(i)` false: failed, or no outcome).
    pub(crate) fn stop_failed(
        &mut self,
        sent: &[usize],
        confirmed: impl Fn(usize) -> bool,
        rounds: &Rounds,
    ) {
        for &i in sent {
            if !confirmed(i)
                && let Some(k) = rounds.key[i]
            {
                self.stopped[k] = true;
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::relay::plan;
    use std::collections::BTreeMap;
    use std::time::Duration;

    /// The retry policy of these tests: a message may be claimed 3 times.
    const POLICY: Policy = Policy {
        max_attempts: 3,
        backoff_base: Duration::from_secs(1),
        backoff_max: Duration::from_secs(60),
        delete_dispatched: false,
    };

    fn keyed(id: i64, topic: &str, key: Option<&str>) -> OutgoingMessage {
        OutgoingMessage {
            id,
            message_id: uuid::Uuid::now_v7(),
            topic: topic.into(),
            key: key.map(str::to_owned),
            payload: bytes::Bytes::from_static(b"x"),
            headers: BTreeMap::new(),
            occurred_at: chrono::Utc::now(),
            attempts: 1,
        }
    }

    #[test]
    fn an_ordered_key_goes_out_one_message_per_round() {
        let ordering = KeyOrdering {
            topics: vec![crate::topic::TopicPattern::parse("orders.>").unwrap()],
            skip_dead: false,
        };
        let batch = [
            keyed(1, "orders.placed", Some("a")),
            keyed(2, "orders.placed", Some("b")),
            keyed(3, "orders.placed", Some("a")),
            keyed(4, "orders.placed", None),
            keyed(5, "orders.paid", Some("a")), // another topic: another sequence
            keyed(6, "audit.seen", Some("a")),  // not ordered
            keyed(7, "orders.placed", Some("a")),
            keyed(8, "audit.seen", Some("a")),
        ];
        let r = rounds(&batch, &ordering);
        assert_eq!(r.of, vec![vec![0, 1, 3, 4, 5, 7], vec![2], vec![6]]);
        // Keys: orders.placed/a 0, orders.placed/b 1, orders.paid/a 2.
        assert_eq!(
            r.key,
            vec![
                Some(0),
                Some(1),
                Some(0),
                None,
                Some(2),
                None,
                Some(0),
                None
            ]
        );
        assert_eq!(r.keys, 3);
        // Without ordering, one round.
        let r = rounds(&batch, &KeyOrdering::default());
        assert_eq!(r.of, vec![(0..8).collect::<Vec<_>>()]);
        assert_eq!((r.keys, r.key.iter().flatten().count()), (0, 0));
    }

    /// Orders `orders.>` strictly (dead letters hold their keys).
    fn strict() -> KeyOrdering {
        KeyOrdering {
            topics: vec![crate::topic::TopicPattern::parse("orders.>").unwrap()],
            skip_dead: false,
        }
    }

    /// `m`, claimed once more than [`POLICY`] allows.
    fn over(m: OutgoingMessage) -> OutgoingMessage {
        OutgoingMessage {
            attempts: POLICY.max_attempts + 1,
            ..m
        }
    }

    fn malformed(id: i64) -> Dead {
        Dead {
            id,
            error: "malformed row: bad headers".into(),
        }
    }

    #[test]
    fn a_malformed_row_stops_every_later_message_under_strict_ordering() {
        let batch = [
            keyed(1, "orders.placed", Some("a")),
            keyed(2, "audit.seen", None),
            keyed(4, "audit.seen", None), // not ordered, but after the malformed row
            keyed(6, "orders.placed", Some("b")),
        ];
        let rows = [malformed(7), malformed(3)];
        let d = DeadStops::of(&batch, &rows, &strict(), &POLICY);
        assert_eq!((d.after, d.keys.len()), (3, 0));
        assert!(!d.is_empty(), "the claim is not published whole");
        let r = rounds(&batch, &strict());
        let stops = KeyStops::at_claim(&d, &batch, &r);
        assert_eq!(stops.pick(&r.of[0], &batch, &r), vec![0, 1]);
        // Without strict ordering a malformed row stops nothing.
        let lax = KeyOrdering {
            skip_dead: true,
            ..strict()
        };
        for ordering in [lax, KeyOrdering::default()] {
            let d = DeadStops::of(&batch, &rows, &ordering, &POLICY);
            assert_eq!(d.after, i64::MAX, "{ordering}");
            assert!(d.is_empty(), "{ordering}");
        }
    }

    #[test]
    fn a_message_past_max_attempts_stops_its_key_under_strict_ordering() {
        let claim = vec![
            over(keyed(1, "orders.placed", Some("a"))),
            keyed(2, "orders.placed", Some("a")),
            keyed(3, "orders.placed", Some("b")),
            over(keyed(4, "audit.seen", Some("b"))), // not ordered: stops nothing
            over(keyed(5, "orders.paid", None)),
        ];
        let d = DeadStops::of(&claim, &[], &strict(), &POLICY);
        assert_eq!(d.after, i64::MAX);
        assert_eq!(
            d.keys,
            vec![
                ("orders.placed".to_owned(), Some("a".to_owned())),
                ("orders.paid".to_owned(), None)
            ]
        );
        assert!(!d.is_empty(), "the claim is not published whole");
        let (publish, dead) = plan(claim.clone(), &POLICY);
        assert_eq!(dead.len(), 3);
        // To publish: 2 (orders.placed/a, key 0) and 3 (orders.placed/b, key 1).
        let r = rounds(&publish, &strict());
        let stops = KeyStops::at_claim(&d, &publish, &r);
        assert_eq!(stops.stopped, vec![true, false]);
        assert_eq!(stops.pick(&r.of[0], &publish, &r), vec![1]);
        // Without strict ordering the key goes on.
        let lax = KeyOrdering {
            skip_dead: true,
            ..strict()
        };
        let d = DeadStops::of(&claim, &[], &lax, &POLICY);
        assert!(d.is_empty());
        let r = rounds(&publish, &lax);
        let stops = KeyStops::at_claim(&d, &publish, &r);
        assert_eq!(stops.pick(&r.of[0], &publish, &r), vec![0, 1]);
    }

    #[test]
    fn a_key_sent_without_ok_stops_its_later_rounds() {
        let batch = [
            keyed(1, "orders.placed", Some("a")),
            keyed(2, "orders.placed", Some("b")),
            keyed(3, "audit.seen", Some("a")),
            keyed(4, "orders.placed", Some("a")),
            keyed(5, "orders.placed", Some("b")),
        ];
        let r = rounds(&batch, &strict());
        assert_eq!(r.of, vec![vec![0, 1, 2], vec![3, 4]]);
        let d = DeadStops::of(&batch, &[], &strict(), &POLICY);
        assert!(d.is_empty());
        let mut stops = KeyStops::at_claim(&d, &batch, &r);
        let sent = stops.pick(&r.of[0], &batch, &r);
        assert_eq!(sent, vec![0, 1, 2]);
        // orders.placed/a failed, orders.placed/b confirmed, the message that is not
        // ordered failed (it has no key to stop).
        stops.stop_failed(&sent, |i| i == 1, &r);
        assert_eq!(stops.stopped, vec![true, false]);
        assert_eq!(stops.pick(&r.of[1], &batch, &r), vec![4]);
    }
}
