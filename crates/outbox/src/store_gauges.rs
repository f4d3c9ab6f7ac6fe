//! The store's samples read as the metrics' plain values ([`crate::metrics`] imports no
//! store type): the one place that knows both, above the two of them.

use crate::metrics::{HorizonGauges, OrderingGauges, PauseGauges, StoreGauges};
use crate::store::{CleanupHorizon, HeldKeys, Overview, PauseState};

impl<'a> From<&'a Overview> for StoreGauges<'a> {
    fn from(o: &'a Overview) -> Self {
        let c = &o.counts;
        StoreGauges {
            pending: c.pending,
            claimed: c.claimed,
            dispatched: c.dispatched,
            dead: c.dead,
            oldest_pending_age_s: c.oldest_pending_age_seconds,
            due: o.due,
            expired_claims: o.expired_claims,
            dead_by_topic: &o.dead_by_topic,
        }
    }
}

impl From<&PauseState> for PauseGauges {
    fn from(p: &PauseState) -> Self {
        PauseGauges {
            paused: p.paused,
            topic_pauses: p.topics.len(),
        }
    }
}

impl From<&HeldKeys> for OrderingGauges {
    fn from(h: &HeldKeys) -> Self {
        OrderingGauges {
            blocked_keys: h.blocked_keys,
            held: h.held,
            oldest_held_age_s: h.oldest_held_age_seconds,
        }
    }
}

impl From<&CleanupHorizon> for HorizonGauges {
    fn from(h: &CleanupHorizon) -> Self {
        HorizonGauges {
            oldest_transaction_age_s: h.oldest.as_ref().map(|t| t.age_s),
            xmin_age: h.xmin_age,
        }
    }
}
