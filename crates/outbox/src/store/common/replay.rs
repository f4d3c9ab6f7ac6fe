//! The replay or discard of dead rows ([`crate::store::Operations::replay`]) as one
//! transaction, and the reading of dead letters and audit rows: the same steps in every
//! store; each store supplies its statements through [`ReplaySteps`].

use crate::error::Result;
use crate::store::ops::{self, Dialect};
use crate::store::{DeadLetter, ReplayOutcome, ReplayRecord, ReplayRequest};
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Database, Transaction};
use uuid::Uuid;

/// A store's transaction, as the steps of a replay share it.
pub(crate) type Tx<S> = Transaction<'static, <S as ReplaySteps>::Db>;

/// The statements of a replay that differ from store to store, in the order
/// [`replay`] runs them, all in the one transaction.
#[async_trait]
pub(crate) trait ReplaySteps: Sync {
    /// The store's database.
    type Db: Database;
    /// What a store reads while it locks the selected rows, for [`ReplaySteps::change`]
    /// (MySQL: the keyed rows among them; elsewhere nothing).
    type Held: Send;
    /// The dialect the selector's filters are written in.
    const DIALECT: Dialect;

    /// The rows a selector names by id or message id (`filter`, from
    /// [`ops::named_filter`]), whatever their status: (id, message id, status).
    async fn named(&self, tx: &mut Tx<Self>, filter: &str) -> Result<Vec<(i64, Uuid, i16)>>;

    /// The selected dead rows' ids, in id order, at most `req.limit` of them.
    async fn select(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<Vec<i64>>;

    /// The selected rows locked while still dead, and what the store reads with them.
    async fn lock(&self, tx: &mut Tx<Self>, selected: Vec<i64>) -> Result<(Vec<i64>, Self::Held)>;

    /// Writes the audit row of `req` and returns its id.
    async fn record(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<i64>;

    /// Replays or deletes the rows of `change`, gives back the followers they held
    /// parked, and returns the number of rows changed.
    async fn change(&self, tx: &mut Tx<Self>, change: Change<'_>, held: Self::Held) -> Result<u64>;

    /// Adds `changed` to the count of the audit row `replay_id`.
    async fn count(&self, tx: &mut Tx<Self>, changed: u64, replay_id: i64) -> Result<()>;
}

/// What [`ReplaySteps::change`] changes: the request, the locked rows' ids in id order,
/// and the audit row the change is counted in.
pub(crate) struct Change<'a> {
    pub(crate) req: &'a ReplayRequest,
    pub(crate) ids: &'a [i64],
    pub(crate) replay_id: i64,
}

/// A replay or discard in the transaction `tx` (the request already validated): the
/// refusals of named rows that are not dead, the selection, the dry run, the audit row,
/// the change and the count, committed together.
pub(crate) async fn replay<S: ReplaySteps>(
    store: &S,
    mut tx: Tx<S>,
    req: &ReplayRequest,
) -> Result<ReplayOutcome> {
    let refused = match ops::named_filter(&req.selector, S::DIALECT) {
        Some(filter) => ops::refusals(&req.selector, &store.named(&mut tx, &filter).await?),
        None => Vec::new(),
    };
    let selected = store.select(&mut tx, req).await?;
    ops::check_spread(selected.len(), req.rate_per_s)?;
    if req.dry_run || selected.is_empty() {
        tx.rollback().await?;
        return Ok(unchanged(&selected, refused));
    }
    let (ids, held) = store.lock(&mut tx, selected).await?;
    if ids.is_empty() {
        tx.rollback().await?;
        return Ok(unchanged(&ids, refused));
    }
    let replay_id = match req.append_to {
        Some(id) => id,
        None => store.record(&mut tx, req).await?,
    };
    let change = Change {
        req,
        ids: &ids,
        replay_id,
    };
    let changed = store.change(&mut tx, change, held).await?;
    store.count(&mut tx, changed, replay_id).await?;
    tx.commit().await?;
    Ok(ReplayOutcome {
        replay_id: Some(replay_id),
        count: changed,
        sample: sample(&ids),
        refused,
    })
}

/// The outcome of a dry run, or of a selection that found nothing to change.
fn unchanged(ids: &[i64], refused: Vec<ops::Refused>) -> ReplayOutcome {
    ReplayOutcome {
        replay_id: None,
        count: ids.len() as u64,
        sample: sample(ids),
        refused,
    }
}

/// The first 20 ids, as an outcome shows them.
fn sample(ids: &[i64]) -> Vec<i64> {
    ids.iter().take(20).copied().collect()
}

/// The delay of each replayed row, by id (spread at the request's rate); none for a
/// discard or purge, whose rows release their followers at once.
pub(crate) fn delays(req: &ReplayRequest, ids: &[i64]) -> std::collections::HashMap<i64, i64> {
    match req.action {
        crate::store::ReplayAction::Replay => ids
            .iter()
            .enumerate()
            .map(|(k, &id)| (id, ops::spread_ms(k, req.rate_per_s)))
            .collect(),
        crate::store::ReplayAction::Discard | crate::store::ReplayAction::Purge => {
            Default::default()
        }
    }
}

/// `sql` (a statement that reads one `i64` a row) with the selector's strings bound in
/// order.
pub(crate) fn bound<'q, DB>(
    sql: String,
    binds: Vec<String>,
) -> sqlx::query::QueryScalar<'q, DB, i64, <DB as Database>::Arguments>
where
    DB: Database,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
    String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let mut query = sqlx::query_scalar::<DB, i64>(AssertSqlSafe(sql));
    for b in binds {
        query = query.bind(b);
    }
    query
}

/// A count the database returns, as a `u64` (a negative one is 0).
pub(crate) fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// An audit row as the stores read it: id, time, by, reason, action, selection, count.
pub(crate) type ReplayRow<T> = (i64, T, String, String, String, String, i64);

/// The audit rows, with each store's time converted by `at`.
pub(crate) fn replay_records<T>(
    rows: Vec<ReplayRow<T>>,
    at: impl Fn(T) -> DateTime<Utc>,
) -> Vec<ReplayRecord> {
    rows.into_iter()
        .map(
            |(id, t, by, reason, action, selection, count)| ReplayRecord {
                id,
                at: at(t),
                by,
                reason,
                action,
                selection,
                count,
            },
        )
        .collect()
}

/// The columns of a dead letter each store decodes its own way: the message id, the
/// text columns and the times.
pub(crate) struct DeadText {
    pub(crate) message_id: Uuid,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    pub(crate) headers: String,
    pub(crate) occurred_at: DateTime<Utc>,
    pub(crate) died_at: DateTime<Utc>,
}

/// A dead letter from a row of the store's `dead_letters` statement: the columns every
/// store decodes alike read here, the rest given as `text`.
pub(crate) fn dead_letter<R>(r: &R, text: DeadText) -> Result<DeadLetter>
where
    R: sqlx::Row,
    &'static str: sqlx::ColumnIndex<R>,
    i64: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    i32: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    String: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    Vec<u8>: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
{
    Ok(DeadLetter {
        id: r.try_get("id")?,
        message_id: text.message_id,
        topic: text.topic,
        key: text.key,
        attempts: r.try_get("attempts")?,
        occurred_at: text.occurred_at,
        died_at: text.died_at,
        last_error: r.try_get("last_error")?,
        headers: text.headers,
        payload_bytes: r.try_get("payload_bytes")?,
        payload: r.try_get("payload")?,
        replay_id: r.try_get("replay_id")?,
        waiting_behind: r.try_get("waiting_behind")?,
    })
}
