//! The metrics the library records, through the [`metrics`] facade: nothing is recorded,
//! and nothing costs more than a relaxed atomic load, unless the host application
//! installs a recorder (`outbox relay --metrics-addr` installs a Prometheus one). The
//! names, types and labels are listed in `ops/METRICS.md`; they follow the Prometheus
//! conventions (base units, `_total`, `_seconds`) and, for labels, the OpenTelemetry
//! messaging conventions where one applies (`messaging_system`).
//!
//! Every name is a constant here, so a rename is one edit and the operations files
//! (`ops/`) are checked against the same list.

use metrics::{counter, gauge, histogram};
use std::time::Duration;

/// Gauge (always 1): `version`, `store`, `sink` of this relay.
pub const RELAY_INFO: &str = "outbox_relay_info";
/// Counter: message publish outcomes by `destination`, `messaging_system`, `outcome`, `reason`.
pub const PUBLISHES: &str = "outbox_publishes_total";
/// Counter: messages with no confirmation within their timeout, by `destination` and
/// `outcome`: `timed_out_after_send` (sent, not answered in time: an attempt counted),
/// `timed_out_after_send_refunded` (the same, one of the message's first
/// [`crate::sink::router::TIMEOUT_REFUNDS`]: attempt given back), `timed_out` (not known
/// to be sent, while the destination confirmed others: an attempt counted),
/// `timed_out_outage` (not known to be sent, the destination confirmed nothing: attempt
/// given back).
pub const PUBLISH_TIMEOUTS: &str = "outbox_publish_timeouts_total";
/// Counter: rows quarantined, by `reason` (`permanent`, `max_attempts`, `malformed`).
pub const QUARANTINED: &str = "outbox_messages_quarantined_total";
/// Counter: rows rescheduled.
pub const RETRIED: &str = "outbox_messages_retried_total";
/// Counter: rows given back unpublished.
pub const RELEASED: &str = "outbox_messages_released_total";
/// Counter: rows whose claim passed to another relay.
pub const CLAIMS_LOST: &str = "outbox_claims_lost_total";
/// Counter: successful lease renewals.
pub const LEASE_RENEWALS: &str = "outbox_lease_renewals_total";
/// Counter: failed store calls, by `operation`.
pub const STORE_ERRORS: &str = "outbox_store_errors_total";
/// Counter: dispatched rows deleted by purge.
pub const PURGE_ROWS: &str = "outbox_purge_rows_total";
/// Counter: purge batches run.
pub const PURGE_RUNS: &str = "outbox_purge_runs_total";
/// Histogram (s): one claim statement.
pub const CLAIM_DURATION: &str = "outbox_claim_duration_seconds";
/// Histogram (s): one settle statement.
pub const SETTLE_DURATION: &str = "outbox_settle_duration_seconds";
/// Histogram (messages): rows per non-empty claim.
pub const BATCH_SIZE: &str = "outbox_batch_size";
/// Histogram (s): a batch's publish until every outcome is in (or the wait ended).
pub const BATCH_PUBLISH_DURATION: &str = "outbox_batch_publish_duration_seconds";
/// Histogram (s): publish start → one message's confirmation, by `destination`.
pub const MESSAGE_CONFIRM_DURATION: &str = "outbox_message_confirm_duration_seconds";
/// Histogram (s): `occurred_at` → confirmation, on the database clock.
pub const ENQUEUE_TO_CONFIRM: &str = "outbox_enqueue_to_confirm_seconds";
/// Gauge: rows by `status` (store sample).
pub const MESSAGES: &str = "outbox_messages";
/// Gauge (s): the oldest pending row's age (store sample; 0 when none).
pub const OLDEST_PENDING_AGE: &str = "outbox_oldest_pending_age_seconds";
/// Gauge: rows due now (store sample).
pub const DUE: &str = "outbox_messages_due";
/// Gauge: claimed rows whose lease ended (store sample).
pub const CLAIMS_EXPIRED: &str = "outbox_claims_expired";
/// Gauge: dead rows by `topic`, top 10 and `other` (store sample).
pub const DEAD_BY_TOPIC: &str = "outbox_dead_messages";
/// Gauge: relays with a fresh heartbeat (store sample).
pub const RELAYS_ALIVE: &str = "outbox_relays_alive";
/// Gauge: active topic pauses (store sample).
pub const TOPIC_PAUSES: &str = "outbox_topic_pauses";
/// Gauge: 1 while the global pause switch is on (store sample).
pub const PAUSED: &str = "outbox_paused";
/// Gauge: keys of ordered topics blocked by a dead letter (store sample; strict
/// ordering only).
pub const ORDERED_BLOCKED_KEYS: &str = "outbox_ordered_blocked_keys";
/// Gauge: messages waiting behind those dead letters (store sample).
pub const ORDERED_HELD: &str = "outbox_ordered_held_messages";
/// Gauge (s): the oldest of them's age, database clock (store sample; 0 when none).
pub const ORDERED_OLDEST_HELD_AGE: &str = "outbox_ordered_oldest_held_age_seconds";
/// Gauge (s): the oldest open transaction of another session that holds back the
/// cleanup of dead row versions (store sample; PostgreSQL and MySQL/MariaDB; 0 when none).
pub const OLDEST_TRANSACTION_AGE: &str = "outbox_oldest_transaction_age_seconds";
/// Gauge (transaction ids): the age of the oldest `xmin` holding back cleanup in the
/// database: sessions, prepared transactions, replication slots (store sample;
/// PostgreSQL only).
pub const OLDEST_XMIN_AGE: &str = "outbox_oldest_xmin_age_transactions";
/// Counter: heartbeats that found this relay's id held by another live process.
pub const RELAY_ID_CONFLICTS: &str = "outbox_relay_id_conflicts_total";
/// Gauge (one-hot): each destination's `state` (`up`, `down`, `open`).
pub const DESTINATION_STATE: &str = "outbox_destination_state";

/// Every name above, for documentation checks.
pub const ALL: [&str; 32] = [
    RELAY_INFO,
    PUBLISHES,
    PUBLISH_TIMEOUTS,
    QUARANTINED,
    RETRIED,
    RELEASED,
    CLAIMS_LOST,
    LEASE_RENEWALS,
    STORE_ERRORS,
    PURGE_ROWS,
    PURGE_RUNS,
    CLAIM_DURATION,
    SETTLE_DURATION,
    BATCH_SIZE,
    BATCH_PUBLISH_DURATION,
    MESSAGE_CONFIRM_DURATION,
    ENQUEUE_TO_CONFIRM,
    MESSAGES,
    OLDEST_PENDING_AGE,
    DUE,
    CLAIMS_EXPIRED,
    DEAD_BY_TOPIC,
    RELAYS_ALIVE,
    TOPIC_PAUSES,
    ORDERED_BLOCKED_KEYS,
    ORDERED_HELD,
    ORDERED_OLDEST_HELD_AGE,
    PAUSED,
    DESTINATION_STATE,
    OLDEST_TRANSACTION_AGE,
    OLDEST_XMIN_AGE,
    RELAY_ID_CONFLICTS,
];

/// Counts `n` messages to `destination` with one publish outcome.
pub(crate) fn publish(
    destination: &str,
    system: &'static str,
    outcome: &'static str,
    reason: &'static str,
    n: u64,
) {
    counter!(PUBLISHES, "destination" => destination.to_owned(), "messaging_system" => system, "outcome" => outcome, "reason" => reason).increment(n);
}

/// Counts `n` timed-out messages to `destination` with one timeout `outcome` (see
/// [`PUBLISH_TIMEOUTS`]); nothing when `n` is 0.
pub(crate) fn publish_timeouts(destination: &str, outcome: &'static str, n: u64) {
    if n > 0 {
        counter!(PUBLISH_TIMEOUTS, "destination" => destination.to_owned(), "outcome" => outcome)
            .increment(n);
    }
}

/// The publish → confirmation histogram of one destination (a handle: one key per
/// batch, not per message).
pub(crate) fn confirm_durations(destination: &str) -> metrics::Histogram {
    histogram!(MESSAGE_CONFIRM_DURATION, "destination" => destination.to_owned())
}

/// Adds `n` to a label-less counter.
pub(crate) fn add(name: &'static str, n: u64) {
    if n > 0 {
        counter!(name).increment(n);
    }
}

/// Counts one purge batch that deleted `rows` dispatched rows.
pub(crate) fn purged(rows: u64) {
    counter!(PURGE_RUNS).increment(1);
    counter!(PURGE_ROWS).increment(rows);
}

/// Counts `n` quarantined rows for `reason`.
pub(crate) fn quarantined(reason: &'static str, n: u64) {
    if n > 0 {
        counter!(QUARANTINED, "reason" => reason).increment(n);
    }
}

/// Counts a failed store call.
pub(crate) fn store_error(operation: &'static str) {
    counter!(STORE_ERRORS, "operation" => operation).increment(1);
}

/// Records a duration in seconds.
pub(crate) fn seconds(name: &'static str, d: Duration) {
    histogram!(name).record(d.as_secs_f64());
}

/// The histogram `name` (a handle, for recording many values under one key).
pub(crate) fn seconds_histogram(name: &'static str) -> metrics::Histogram {
    histogram!(name)
}

/// Records a plain value.
pub(crate) fn value(name: &'static str, v: f64) {
    histogram!(name).record(v);
}

/// What the store gauges show of a store sample (the relay's `Store::overview`), as plain
/// values: metrics reads no store type (the conversion from the store's types is beside
/// the relay, in the crate's `store_gauges` module).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StoreGauges<'a> {
    /// Rows by status: pending, claimed, dispatched, dead.
    pub pending: i64,
    pub claimed: i64,
    pub dispatched: i64,
    pub dead: i64,
    /// Seconds the oldest pending row has waited; `None` when none is pending.
    pub oldest_pending_age_s: Option<i64>,
    /// Rows due now.
    pub due: i64,
    /// Claimed rows whose lease has ended.
    pub expired_claims: i64,
    /// Dead rows of the topics with the most, by topic (the rest are `other`).
    pub dead_by_topic: &'a [(String, i64)],
}

/// What the pause gauges show: whether the outbox is paused, and how many topics are.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PauseGauges {
    /// The whole outbox is paused.
    pub paused: bool,
    /// Topic patterns paused.
    pub topic_pauses: usize,
}

/// What the ordering gauges show of a per-key ordering sample.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OrderingGauges {
    /// Keys whose next row waits behind a dead letter or a later row.
    pub blocked_keys: i64,
    /// Rows held back.
    pub held: i64,
    /// Seconds the oldest held row has waited; `None` when none is held.
    pub oldest_held_age_s: Option<i64>,
}

/// What the cleanup horizon gauges show.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HorizonGauges {
    /// Age in seconds of the oldest open transaction; `None` when there is none.
    pub oldest_transaction_age_s: Option<f64>,
    /// PostgreSQL's xmin horizon age, in transactions, where the store tells it.
    pub xmin_age: Option<i64>,
}

/// Sets the store gauges from an overview and the registry.
pub(crate) fn store_sample<'a>(
    o: impl Into<StoreGauges<'a>>,
    relays_alive: usize,
    pause: impl Into<PauseGauges>,
) {
    let o = o.into();
    let pause = pause.into();
    for (status, n) in [
        (crate::status::Status::Pending.as_str(), o.pending),
        (crate::status::Status::Claimed.as_str(), o.claimed),
        (crate::status::Status::Dispatched.as_str(), o.dispatched),
        (crate::status::Status::Dead.as_str(), o.dead),
    ] {
        gauge!(MESSAGES, "status" => status).set(n as f64);
    }
    gauge!(OLDEST_PENDING_AGE).set(o.oldest_pending_age_s.unwrap_or(0) as f64);
    gauge!(DUE).set(o.due as f64);
    gauge!(CLAIMS_EXPIRED).set(o.expired_claims as f64);
    let mut listed = 0;
    for (topic, n) in o.dead_by_topic {
        gauge!(DEAD_BY_TOPIC, "topic" => topic.clone()).set(*n as f64);
        listed += n;
    }
    gauge!(DEAD_BY_TOPIC, "topic" => "other").set((o.dead - listed).max(0) as f64);
    gauge!(RELAYS_ALIVE).set(relays_alive as f64);
    gauge!(TOPIC_PAUSES).set(pause.topic_pauses as f64);
    gauge!(PAUSED).set(if pause.paused { 1.0 } else { 0.0 });
}

/// Sets the ordering gauges from a store sample (`Views::held_keys`).
pub(crate) fn ordering_sample(h: impl Into<OrderingGauges>) {
    let h = h.into();
    gauge!(ORDERED_BLOCKED_KEYS).set(h.blocked_keys as f64);
    gauge!(ORDERED_HELD).set(h.held as f64);
    gauge!(ORDERED_OLDEST_HELD_AGE).set(h.oldest_held_age_s.unwrap_or(0) as f64);
}

/// Sets the cleanup horizon gauges from a store sample (`Views::cleanup_horizon`) of a
/// store of `kind`; the xmin age only where the store tells it.
pub(crate) fn horizon_sample(kind: &str, h: impl Into<HorizonGauges>) {
    if !matches!(kind, "postgres" | "mysql") {
        return; // nothing to tell: no gauge rather than a 0 that would mean "none"
    }
    let h = h.into();
    gauge!(OLDEST_TRANSACTION_AGE).set(h.oldest_transaction_age_s.unwrap_or(0.0));
    if let Some(x) = h.xmin_age {
        gauge!(OLDEST_XMIN_AGE).set(x as f64);
    }
}

/// The `messaging_system` label of a sink, from the scheme of its description (the
/// OpenTelemetry `messaging.system` names where one exists: `kafka`, `rabbitmq`; else the
/// sink's own: `nats`, `redis`, `mqtt`, `http`, `file`).
pub(crate) fn system_of(describe: &str) -> &'static str {
    // The first word with a scheme: "webhook https://…" is http, "mqtt://… client id …" mqtt.
    let word = describe
        .split_whitespace()
        .find(|w| w.contains(':'))
        .unwrap_or(describe);
    let scheme = word.split(':').next().unwrap_or_default();
    match scheme {
        "nats" | "tls" => "nats",
        "kafka" => "kafka",
        "amqp" | "amqps" => "rabbitmq",
        "redis" | "rediss" => "redis",
        "mqtt" | "mqtts" => "mqtt",
        "http" | "https" => "http",
        "file" | "stdout" => "file",
        "handler" => "handler",
        _ => "other",
    }
}

/// Sets the one-hot destination state gauges.
pub(crate) fn destination_state(destination: &str, state: &'static str) {
    for s in ["up", "down", "open"] {
        gauge!(DESTINATION_STATE, "destination" => destination.to_owned(), "state" => s)
            .set(if s == state { 1.0 } else { 0.0 });
    }
}

/// Sets the relay info gauge.
pub(crate) fn relay_info(store: &str, sink: &str) {
    gauge!(RELAY_INFO, "version" => env!("CARGO_PKG_VERSION"), "store" => store.to_owned(), "sink" => sink.to_owned()).set(1.0);
}

/// Describes every metric (help text and unit) to the installed recorder, and sets the
/// label-less counters to 0 so a rate over them starts at the first scrape rather than
/// at the first event. Call once after installing a recorder.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(
        RELAY_INFO,
        "One series per relay process (value 1): version, store and sink."
    );
    describe_counter!(
        PUBLISHES,
        "Message publish outcomes by destination, messaging system, outcome (ok, transient, permanent, unavailable, timed_out) and reason code."
    );
    describe_counter!(
        QUARANTINED,
        "Rows moved to dead, by reason (permanent, max_attempts, malformed)."
    );
    describe_counter!(
        RETRIED,
        "Rows rescheduled after a failed publish (transient, unavailable or timed out)."
    );
    describe_counter!(
        RELEASED,
        "Rows given back unpublished, attempt refunded: the shutdown grace ran out, or an earlier message of their ordered key in the same claim failed."
    );
    describe_counter!(
        CLAIMS_LOST,
        "Rows whose claim passed to another relay before this one settled them."
    );
    describe_counter!(LEASE_RENEWALS, "Lease renewals of batches still in flight.");
    describe_counter!(STORE_ERRORS, "Store calls that failed, by operation.");
    describe_counter!(PURGE_ROWS, "Dispatched rows deleted by purge.");
    describe_counter!(
        RELAY_ID_CONFLICTS,
        "Heartbeats that found this relay's id held by another live process (two relays under one --relay-id)."
    );
    describe_counter!(PURGE_RUNS, "Purge batches run.");
    describe_histogram!(
        CLAIM_DURATION,
        Unit::Seconds,
        "Duration of one claim statement."
    );
    describe_histogram!(
        SETTLE_DURATION,
        Unit::Seconds,
        "Duration of one settle statement."
    );
    describe_histogram!(BATCH_SIZE, Unit::Count, "Rows per claim that found rows.");
    describe_histogram!(
        BATCH_PUBLISH_DURATION,
        Unit::Seconds,
        "A batch's publish until every outcome was in (or the wait ended)."
    );
    describe_histogram!(
        MESSAGE_CONFIRM_DURATION,
        Unit::Seconds,
        "Publish start to one message's confirmation, by destination."
    );
    describe_histogram!(
        ENQUEUE_TO_CONFIRM,
        Unit::Seconds,
        "occurred_at to the broker's confirmation, on the database clock."
    );
    describe_gauge!(
        MESSAGES,
        "Rows by status (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        OLDEST_PENDING_AGE,
        Unit::Seconds,
        "Age of the oldest pending row, database clock; 0 when none (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        DUE,
        "Rows due now: pending and due, or claimed with an ended lease (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        CLAIMS_EXPIRED,
        "Claimed rows whose lease has ended (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        DEAD_BY_TOPIC,
        "Dead rows by topic: the 10 largest topics and other (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        RELAYS_ALIVE,
        "Relays with a fresh registry heartbeat (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        TOPIC_PAUSES,
        "Topic pauses in force (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        ORDERED_BLOCKED_KEYS,
        "Keys of ordered topics blocked by a dead letter (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        ORDERED_HELD,
        "Messages waiting behind dead letters of ordered keys (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        ORDERED_OLDEST_HELD_AGE,
        Unit::Seconds,
        "Age of the oldest message waiting behind a dead letter of its key (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        PAUSED,
        "1 while the global pause switch is on (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters)."
    );
    describe_gauge!(
        OLDEST_TRANSACTION_AGE,
        Unit::Seconds,
        "Age of the oldest open transaction of another session holding back the cleanup of dead row versions; claims slow down while it stays open; 0 when none (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters; PostgreSQL, MySQL/MariaDB)."
    );
    describe_gauge!(
        OLDEST_XMIN_AGE,
        "Age in transaction ids of the oldest xmin holding back cleanup: sessions, prepared transactions, replication slots (store sample: read every --sample-interval-s, 15 s by default, so up to that far behind the counters; PostgreSQL)."
    );
    describe_gauge!(
        DESTINATION_STATE,
        "Each destination's state, one-hot: up, down (failing), open (breaker open)."
    );
    for name in [
        RETRIED,
        RELEASED,
        CLAIMS_LOST,
        LEASE_RENEWALS,
        PURGE_ROWS,
        PURGE_RUNS,
        RELAY_ID_CONFLICTS,
    ] {
        counter!(name).absolute(0);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn messaging_system_from_any_sink_description() {
        for (d, want) in [
            ("nats://127.0.0.1:4222", "nats"),
            ("webhook https://hooks.example.com/in", "http"),
            ("mqtt://127.0.0.1:1883 client id outbox-1", "mqtt"),
            ("amqp://127.0.0.1:5672/%2f exchange outbox", "rabbitmq"),
            ("file:/tmp/out.jsonl", "file"),
            ("stdout", "file"),
            ("recording", "other"),
        ] {
            assert_eq!(super::system_of(d), want, "{d}");
        }
    }
}
