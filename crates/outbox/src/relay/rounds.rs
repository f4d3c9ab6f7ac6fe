//! Per-key ordering within one claim, pure: the rounds in which its messages go out
//! ([`rounds`]), a key's messages one after another, different keys together.

use crate::message::OutgoingMessage;
use crate::store::KeyOrdering;

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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

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
            topics: vec![crate::sink::router::TopicPattern::parse("orders.>").unwrap()],
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
}
