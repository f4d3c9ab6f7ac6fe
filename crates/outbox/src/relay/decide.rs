//! The pure decisions of the relay: which claimed messages go out ([`plan`]) and what to
//! write for each ([`decide`]); the rounds of ordered keys are in `rounds`. No IO, no
//! clock.

use super::config::{OnDispatch, RelayConfig};
use crate::backoff;
use crate::message::OutgoingMessage;
use crate::sink::{ErrorKind, PublishError};
use crate::store::{Dead, Retry, Settlement};
use std::time::Duration;

/// How a batch's wait for its confirmations ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The router returned: every message has an outcome.
    Finished,
    /// The shutdown grace ran out: messages without an outcome are released.
    Abandoned,
    /// The lease could not be renewed in time: messages without an outcome are left to
    /// come back by lease expiry (the store is not reachable to release them anyway).
    LeaseLost,
}

/// The retry policy [`decide`] applies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Policy {
    pub(crate) max_attempts: i32,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) delete_dispatched: bool,
}

impl Policy {
    pub(super) fn of(cfg: &RelayConfig) -> Self {
        Policy {
            max_attempts: cfg.max_attempts,
            backoff_base: cfg.backoff_base,
            backoff_max: cfg.backoff_max,
            delete_dispatched: cfg.on_dispatch == OnDispatch::Delete,
        }
    }
}

/// Delay for an unavailable destination that named none (the router names one whenever
/// a breaker is open).
const UNAVAILABLE_RETRY: Duration = Duration::from_millis(500);

/// The longest delay a destination's `retry_after` can put on a retry: 24 hours (a longer
/// one, or one past what a timestamp holds, would park the row; the stores' date columns
/// could not take it).
pub(crate) const MAX_RETRY_DELAY: Duration = Duration::from_secs(24 * 3600);

/// Splits a claim's messages into those to publish and those already past
/// `max_attempts` (earlier claims ended without an outcome: the relay crashed or lost its
/// lease each time), which are quarantined unpublished.
pub(crate) fn plan(
    messages: Vec<OutgoingMessage>,
    policy: &Policy,
) -> (Vec<OutgoingMessage>, Vec<Dead>) {
    if messages.iter().all(|m| m.attempts <= policy.max_attempts) {
        return (messages, Vec::new()); // the usual claim, moved as it is
    }
    let (publish, over): (Vec<_>, Vec<_>) = messages
        .into_iter()
        .partition(|m| m.attempts <= policy.max_attempts);
    let dead = over
        .iter()
        .map(|m| Dead {
            id: m.id,
            error: format!(
                "attempt {} exceeds max_attempts {}: earlier claims ended without an outcome (relay crashed or lost its lease)",
                m.attempts, policy.max_attempts
            ),
        })
        .collect();
    (publish, dead)
}

/// The pure decision: what to write for each published message, given its outcome (slot
/// `i` is `messages[i]`; `None` = no outcome) and how the wait ended.
///
/// - `Ok` → dispatched;
/// - [`ErrorKind::Unavailable`] → retry after the destination's `retry_after` (its next
///   probe), attempt given back;
/// - transient (and a timeout, should one reach here unjudged) → retry with jittered
///   exponential backoff (at least `retry_after`), or dead once `max_attempts` is reached;
/// - permanent → dead;
/// - no outcome → released when abandoned (shutdown), left alone when the lease was lost,
///   a transient failure otherwise (a sink that returned without one);
/// - held (`held[i]`: never sent, because an earlier message of its ordered key failed or
///   the relay stopped between rounds) → released, attempt given back, unless the lease
///   was lost.
pub(crate) fn decide(
    messages: &[OutgoingMessage],
    outcomes: &[Option<Result<(), PublishError>>],
    held: &[bool],
    ending: Ending,
    policy: &Policy,
) -> Settlement {
    let mut s = Settlement {
        delete_dispatched: policy.delete_dispatched,
        ..Settlement::default()
    };
    for (i, m) in messages.iter().enumerate() {
        if held.get(i).copied().unwrap_or(false) {
            if ending != Ending::LeaseLost {
                s.release.push(m.id);
            }
            continue;
        }
        let outcome = match outcomes.get(i).cloned().flatten() {
            Some(o) => o,
            None => match ending {
                Ending::Abandoned => {
                    s.release.push(m.id);
                    continue;
                }
                Ending::LeaseLost => continue,
                Ending::Finished => Err(PublishError::transient("the sink gave no outcome")),
            },
        };
        match outcome {
            Ok(()) => s.dispatched.push(m.id),
            Err(e) if e.kind == ErrorKind::Unavailable => s.retries.push(Retry {
                id: m.id,
                delay: e
                    .retry_after
                    .unwrap_or(UNAVAILABLE_RETRY)
                    .min(MAX_RETRY_DELAY),
                error: e.to_string(),
                refund_attempt: true,
            }),
            Err(e) if e.is_transient() && m.attempts < policy.max_attempts => {
                let mut delay =
                    backoff::jittered(m.attempts, policy.backoff_base, policy.backoff_max);
                if let Some(after) = e.retry_after {
                    delay = delay.max(after.min(MAX_RETRY_DELAY));
                }
                s.retries.push(Retry {
                    id: m.id,
                    delay,
                    error: e.to_string(),
                    refund_attempt: false,
                });
            }
            Err(e) => {
                let error = if e.is_transient() {
                    format!("gave up after {} attempts; last error: {e}", m.attempts)
                } else {
                    e.to_string()
                };
                s.dead.push(Dead { id: m.id, error });
            }
        }
    }
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn msg(id: i64, attempts: i32) -> OutgoingMessage {
        OutgoingMessage {
            id,
            message_id: uuid::Uuid::now_v7(),
            topic: "t.v1".into(),
            key: None,
            payload: bytes::Bytes::from_static(b"x"),
            headers: BTreeMap::new(),
            occurred_at: chrono::Utc::now(),
            attempts,
        }
    }

    const POLICY: Policy = Policy {
        max_attempts: 3,
        backoff_base: Duration::from_secs(1),
        backoff_max: Duration::from_secs(60),
        delete_dispatched: false,
    };

    #[test]
    fn each_message_is_settled_by_its_own_outcome() {
        let batch = [
            msg(1, 1),
            msg(2, 1),
            msg(3, 1),
            msg(4, 3),
            msg(5, 1),
            msg(6, 1),
        ];
        let outcomes = vec![
            Some(Ok(())),
            Some(Err(PublishError::transient("busy"))),
            Some(Err(PublishError::permanent("too large"))),
            Some(Err(PublishError::transient("busy"))),
            Some(Err(
                PublishError::unavailable("down").with_retry_after(Duration::from_secs(2))
            )),
            None,
        ];
        let s = decide(&batch, &outcomes, &[], Ending::Finished, &POLICY);
        assert_eq!(s.dispatched, vec![1]);
        let retried: Vec<(i64, bool)> =
            s.retries.iter().map(|r| (r.id, r.refund_attempt)).collect();
        // 6: the sink gave no outcome on a finished publish: a transient failure.
        assert_eq!(retried, vec![(2, false), (5, true), (6, false)]);
        let unavailable = s.retries.iter().find(|r| r.id == 5).unwrap();
        assert_eq!(unavailable.delay, Duration::from_secs(2));
        let dead: Vec<i64> = s.dead.iter().map(|d| d.id).collect();
        assert_eq!(dead, vec![3, 4]);
        assert!(
            s.dead[1].error.starts_with("gave up after 3 attempts"),
            "{}",
            s.dead[1].error
        );
        assert!(s.release.is_empty());
    }

    #[test]
    fn confirmed_messages_are_marked_when_the_grace_runs_out() {
        let batch = [msg(1, 1), msg(2, 1), msg(3, 1)];
        let outcomes = vec![Some(Ok(())), None, Some(Ok(()))];
        let s = decide(&batch, &outcomes, &[], Ending::Abandoned, &POLICY);
        assert_eq!(s.dispatched, vec![1, 3]);
        assert_eq!(s.release, vec![2]);
        assert!(s.retries.is_empty() && s.dead.is_empty());
    }

    #[test]
    fn a_lost_lease_settles_only_what_was_confirmed() {
        let batch = [msg(1, 1), msg(2, 1)];
        let outcomes = vec![Some(Ok(())), None];
        let s = decide(&batch, &outcomes, &[], Ending::LeaseLost, &POLICY);
        assert_eq!(s.dispatched, vec![1]);
        assert_eq!(s.len(), 1, "{s:?}");
    }

    #[test]
    fn an_unavailable_destination_never_quarantines() {
        // At the last attempt, an outage still gives the attempt back.
        let batch = [msg(1, 3)];
        let outcomes = vec![Some(Err(PublishError::unavailable("down")))];
        let s = decide(&batch, &outcomes, &[], Ending::Finished, &POLICY);
        assert!(s.dead.is_empty());
        assert!(s.retries[0].refund_attempt);
        assert_eq!(s.retries[0].delay, UNAVAILABLE_RETRY);
    }

    #[test]
    fn rows_past_max_attempts_are_quarantined_unpublished() {
        let (publish, dead) = plan(vec![msg(1, 3), msg(2, 4)], &POLICY);
        assert_eq!(publish.iter().map(|m| m.id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(dead.len(), 1);
        assert!(dead[0].error.contains("exceeds max_attempts 3"));
    }

    #[test]
    fn a_transient_retry_honours_retry_after() {
        let batch = [msg(1, 1)];
        let outcomes = vec![Some(Err(
            PublishError::transient("slow down").with_retry_after(Duration::from_secs(30))
        ))];
        let s = decide(&batch, &outcomes, &[], Ending::Finished, &POLICY);
        assert_eq!(s.retries[0].delay, Duration::from_secs(30));
        assert!(!s.retries[0].refund_attempt);
    }

    #[test]
    fn a_retry_after_beyond_a_day_is_cut_to_a_day() {
        let batch = [msg(1, 1), msg(2, 1)];
        let outcomes = vec![
            Some(Err(
                PublishError::transient("later").with_retry_after(Duration::MAX)
            )),
            Some(Err(
                PublishError::unavailable("down").with_retry_after(Duration::MAX)
            )),
        ];
        let s = decide(&batch, &outcomes, &[], Ending::Finished, &POLICY);
        assert_eq!(s.retries[0].delay, MAX_RETRY_DELAY);
        assert_eq!(s.retries[1].delay, MAX_RETRY_DELAY);
    }

    #[test]
    fn held_messages_are_released_unless_the_lease_was_lost() {
        let batch = [msg(1, 1), msg(2, 1)];
        let outcomes = vec![Some(Err(PublishError::transient("busy"))), None];
        let s = decide(&batch, &outcomes, &[false, true], Ending::Finished, &POLICY);
        assert_eq!(s.retries.len(), 1);
        assert_eq!(s.release, vec![2]);
        let s = decide(
            &batch,
            &outcomes,
            &[false, true],
            Ending::LeaseLost,
            &POLICY,
        );
        assert!(s.release.is_empty());
    }
}
