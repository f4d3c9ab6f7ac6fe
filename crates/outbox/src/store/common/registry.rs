//! The relay registry's rows ([`crate::store::Registry`]), bound and read the same way in
//! every store; each store supplies its statements and its time columns' type.

use crate::error::Result;
use crate::store::{RelayHeartbeat, RelayRecord, millis};
use chrono::{DateTime, Utc};
use sqlx::{Database, SqlSafeStr};

/// The heartbeat statement `sql` with the heartbeat bound in the order every store's
/// statement takes it: relay id, host, pid, version, sink, in flight, ms since the last
/// claim, destinations, instance, lease (ms).
pub(crate) fn heartbeat<'q, DB>(
    sql: impl SqlSafeStr,
    beat: &RelayHeartbeat,
) -> sqlx::query::Query<'q, DB, <DB as Database>::Arguments>
where
    DB: Database,
    String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'q, DB>,
{
    sqlx::query(sql)
        .bind(beat.relay_id.clone())
        .bind(beat.host.clone())
        .bind(beat.pid)
        .bind(beat.version.clone())
        .bind(beat.sink.clone())
        .bind(beat.in_flight)
        .bind(beat.last_claim_ago.map(millis))
        .bind(crate::store::ops::destinations_json(&beat.destinations))
        .bind(beat.instance.clone())
        .bind(millis(beat.lease))
}

/// A registry row as the stores read it: relay id, host, pid, version, sink, in flight,
/// started at, last seen, time since last seen, last claim at, destinations, instance.
pub(crate) type RelayRow<T, A> = (
    String,
    String,
    i64,
    String,
    String,
    i64,
    T,
    T,
    A,
    Option<T>,
    Option<String>,
    String,
);

/// The registry rows, with each store's times converted by `time` and its time since the
/// last heartbeat by `ago_s` (in seconds, negative as 0).
pub(crate) fn relay_records<T, A>(
    rows: Vec<RelayRow<T, A>>,
    time: impl Fn(T) -> DateTime<Utc>,
    ago_s: impl Fn(A) -> f64,
) -> Vec<RelayRecord> {
    rows.into_iter()
        .map(|r| RelayRecord {
            relay_id: r.0,
            instance: r.11,
            host: r.1,
            pid: r.2,
            version: r.3,
            sink: r.4,
            in_flight: r.5,
            started_at: time(r.6),
            last_seen: time(r.7),
            last_seen_ago_s: ago_s(r.8),
            last_claim_at: r.9.map(&time),
            destinations: crate::store::ops::parse_destinations(r.10.as_deref()),
        })
        .collect()
}

/// Deletes the registry row of `relay_id`'s `instance` with the store's statement `sql`
/// (relay id bound first, then instance).
pub(crate) async fn deregister<'c, DB, E>(
    e: E,
    sql: impl SqlSafeStr,
    relay_id: &str,
    instance: &str,
) -> Result<()>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    sqlx::query(sql)
        .bind(relay_id.to_owned())
        .bind(instance.to_owned())
        .execute(e)
        .await?;
    Ok(())
}
