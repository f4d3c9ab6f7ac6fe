//! The admin server (`outbox serve`, `outbox relay --admin-addr`): the dashboard page at
//! `/`, a JSON API under `/api/` over the same operations as the CLI (`cmd/`: the
//! status verdict, dead letters, replay and discard with their checks, the audit, pauses)
//! and `/metrics`, `/healthz`, `/readyz`. Every route but the page and the probes needs a
//! bearer token (`auth`); changes are POST with JSON bodies and record the token's name
//! as who. API answers say `Cache-Control: no-store` (they carry dead letters and
//! payloads); a body over [`MAX_BODY`] is refused with 413; a payload is shown as a
//! preview of at most [`PREVIEW_BYTES`] and downloaded whole from
//! `/api/dead/{id}/payload`.

pub(crate) mod auth;

use crate::cmd::change::{ChangeText, change_request};
use crate::cmd::dead::{self, PayloadView};
use crate::cmd::status::StatusReport;
use crate::serve::{self, Ready};
use crate::shared::CONFIRM_ABOVE;
use crate::text::counted;
use auth::{Caller, Role, Tokens};
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use outbox::store::lookup::MessageQuery;
use outbox::store::{DeadSelector, KeyOrdering, ReplayAction, Store};
use serde::Deserialize;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The page: HTML, CSS and JavaScript in one file, nothing fetched from elsewhere.
const PAGE: &str = include_str!("page.html");

/// Most rows a dead-letter page holds.
const MAX_PAGE: u32 = 500;

/// Largest request body the API reads, in bytes (256 KiB: thousands of ids); a larger one
/// is refused with 413 Payload Too Large.
pub(crate) const MAX_BODY: usize = 256 * 1024;

/// Most payload bytes `GET /api/dead/{id}?payload=true` shows (64 KiB); the rest is
/// downloaded from `/api/dead/{id}/payload`.
pub(crate) const PREVIEW_BYTES: usize = 64 * 1024;

/// What the handlers share.
pub(crate) struct Admin {
    /// The store.
    pub(crate) store: Arc<dyn Store>,
    /// The probes' view (and, inside a relay, its router).
    pub(crate) ready: Arc<Ready>,
    /// The verdict's thresholds.
    pub(crate) limits: outbox::verdict::Limits,
    /// Per-key ordering as the relays run it (which dead letters block their key).
    pub(crate) ordering: KeyOrdering,
}

/// Starts the admin server on `addr` (`flag` names the option in errors) until `cancel`:
/// refuses an open server on an address other than loopback.
///
/// # Errors
/// A bad address, an exposed open server, a bad `OUTBOX_HTTP_HEADER_TIMEOUT`, an address
/// that cannot be bound.
pub(crate) async fn start(
    flag: &str,
    addr: &str,
    tokens: Tokens,
    admin: Admin,
    metrics: PrometheusHandle,
    cancel: CancellationToken,
) -> anyhow::Result<std::net::SocketAddr> {
    let parsed = serve::parse_addr(flag, addr)?;
    auth::check_exposure(flag, parsed, &tokens)?;
    let limits = serve::ListenerLimits::from_env()?;
    let listener = serve::bind(flag, parsed).await?;
    let local = listener.local_addr()?;
    let app = router(Arc::new(admin), Arc::new(tokens), metrics);
    tracing::info!(addr = %local, "serving the dashboard at /, the admin API at /api/, /metrics, /healthz and /readyz");
    serve::spawn(listener, app, cancel, "admin server", limits);
    Ok(local)
}

/// Every route, behind the token check.
fn router(admin: Arc<Admin>, tokens: Arc<Tokens>, metrics: PrometheusHandle) -> Router {
    let api = Router::new()
        .route("/api/me", get(me))
        .route("/api/overview", get(overview))
        .route("/api/dead", get(dead_list))
        .route("/api/dead/{id}", get(dead_show))
        .route("/api/dead/{id}/payload", get(dead_payload))
        .route("/api/dead/replay", post(replay))
        .route("/api/dead/discard", post(discard))
        .route("/api/replays", get(replays))
        .route("/api/pause", post(pause))
        .route("/api/resume", post(resume))
        .route("/api/messages", get(messages))
        .fallback(not_found)
        .with_state(admin.clone())
        .layer(axum::middleware::map_response(no_store))
        .layer(DefaultBodyLimit::max(MAX_BODY));
    Router::new()
        .route("/", get(page))
        .merge(serve::probes(metrics, admin.ready.clone()))
        .merge(api)
        .layer(axum::middleware::from_fn_with_state(
            tokens,
            auth::authenticate,
        ))
}

/// Every API answer: not to be kept by a browser or a proxy (dead letters, payloads).
async fn no_store(mut r: Response) -> Response {
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        axum::http::HeaderValue::from_static("no-store"),
    );
    r
}

/// An API error: a status and a message (as `{"error": …}`).
struct ApiError(StatusCode, String);

impl ApiError {
    fn bad(message: impl std::fmt::Display) -> Self {
        ApiError(StatusCode::BAD_REQUEST, message.to_string())
    }

    /// A JSON body refused: 413 when larger than [`MAX_BODY`], else 400 with the reason.
    fn body(e: &JsonRejection) -> Self {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is larger than {MAX_BODY} bytes"),
            );
        }
        ApiError::bad(e.body_text())
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        // The store's own refusals of a request are the caller's to fix.
        if let Some(outbox::Error::InvalidRequest(m)) = e.downcast_ref::<outbox::Error>() {
            return ApiError::bad(m);
        }
        tracing::warn!(error = %format!("{e:#}"), "admin API: store error");
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"))
    }
}

impl From<outbox::Error> for ApiError {
    fn from(e: outbox::Error) -> Self {
        ApiError::from(anyhow::Error::from(e))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        auth::error(self.0, &self.1)
    }
}

type ApiResult = Result<Json<serde_json::Value>, ApiError>;

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        PAGE,
    )
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError(StatusCode::NOT_FOUND, "no such API route".into())
}

async fn me(Extension(caller): Extension<Caller>) -> ApiResult {
    Ok(Json(
        serde_json::to_value(caller).map_err(anyhow::Error::from)?,
    ))
}

/// The overview: the status report with the verdict (as `status --json --by-topic`),
/// dispatched and dead per minute over the last hour, and the destinations.
async fn overview(State(a): State<Arc<Admin>>) -> ApiResult {
    let report = StatusReport::read(a.store.as_ref(), 10, &a.limits, &a.ordering).await?;
    let mut j = report.to_json(true)?;
    j["throughput"] =
        serde_json::to_value(a.store.throughput(60).await?).map_err(anyhow::Error::from)?;
    // Inside a relay: its router's destinations and their state right now. Every live
    // relay's destinations, as its registry row describes them, are in `relays[].sink`.
    let router = a
        .ready
        .router
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    j["destinations"] = router
        .map(|r| {
            r.destination_states()
                .into_iter()
                .map(|(name, state)| serde_json::json!({ "name": name, "state": state }))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
        .into();
    j["limits"] = serde_json::json!({
        "max_age_seconds": a.limits.max_age.as_secs(),
        "max_dead": a.limits.max_dead,
        "stuck_after_seconds": a.limits.stuck_after.as_secs(),
    });
    Ok(Json(j))
}

/// The dead-letter filters of the list (query string) and of a change (JSON body).
#[derive(Debug, Default)]
struct Filter {
    /// Row ids or message ids.
    ids: Vec<String>,
    /// Topic pattern.
    topic: Option<String>,
    /// Died within this long (15m) or since this RFC 3339 time.
    since: Option<String>,
    /// Last error contains this text.
    error: Option<String>,
}

impl Filter {
    /// The selector, by the CLI's own parsing (empty strings are no criterion).
    fn selector(&self) -> Result<DeadSelector, ApiError> {
        let given = |s: &Option<String>| s.clone().filter(|v| !v.trim().is_empty());
        crate::cmd::change::SelectArgs {
            ids: self.ids.clone(),
            id_range: None,
            topic: given(&self.topic),
            since: given(&self.since),
            error: given(&self.error),
        }
        .selector()
        .map_err(|e| ApiError::bad(format!("{e:#}")))
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    topic: Option<String>,
    since: Option<String>,
    error: Option<String>,
    /// Rows after this row id (the previous page's `next_after`).
    after: Option<i64>,
    limit: Option<u32>,
}

/// Dead letters, oldest first, a page at a time: `rows`, `total` (matching the filters),
/// `next_after` (the cursor of the next page, when there is one).
async fn dead_list(
    State(a): State<Arc<Admin>>,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> ApiResult {
    let Query(q) = q.map_err(|e| ApiError::bad(e.body_text()))?;
    let filter = Filter {
        ids: Vec::new(),
        topic: q.topic,
        since: q.since,
        error: q.error,
    };
    let sel = filter.selector()?;
    let limit = q.limit.unwrap_or(100).clamp(1, MAX_PAGE);
    let mut page_sel = sel.clone();
    if let Some(after) = q.after {
        page_sel.id_range = Some((after.saturating_add(1), i64::MAX));
    }
    let mut rows = a.store.dead_letters(&page_sel, limit + 1, false).await?;
    let shown = usize::try_from(limit).unwrap_or(usize::MAX);
    let more = rows.len() > shown;
    rows.truncate(shown);
    let total = a.store.count_dead(&sel).await?;
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| dead::dead_letter_json(r, &a.ordering))
        .collect::<anyhow::Result<_>>()?;
    let next_after = more
        .then(|| rows.last().and_then(|r| r["id"].as_i64()))
        .flatten();
    Ok(Json(serde_json::json!({
        "rows": rows,
        "total": total,
        "next_after": next_after,
    })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShowQuery {
    /// Include the payload (operator tokens only).
    #[serde(default)]
    payload: bool,
}

/// One dead letter by row id or message id; with `?payload=true` (an operator token) a
/// preview of its payload: at most [`PREVIEW_BYTES`], as text (`payload_text`) or hex
/// (`payload_hex`), `payload_truncated` true when the payload is longer (its size is
/// `payload_bytes`; `/api/dead/{id}/payload` gives it whole).
async fn dead_show(
    State(a): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    q: Result<Query<ShowQuery>, QueryRejection>,
) -> ApiResult {
    let Query(q) = q.map_err(|e| ApiError::bad(e.body_text()))?;
    let r = dead_letter(&a, &caller, &id, q.payload).await?;
    let mut v = dead::dead_letter_json(&r, &a.ordering)?;
    v["headers"] = serde_json::from_str::<serde_json::Value>(&r.headers)
        .unwrap_or_else(|_| r.headers.clone().into());
    if let Some(bytes) = r.payload.as_deref() {
        let (shown, truncated) = preview(bytes);
        match dead::payload_view(shown) {
            PayloadView::Text(t) => v["payload_text"] = t.into(),
            PayloadView::Hex(lines) => v["payload_hex"] = lines.join("\n").into(),
        }
        v["payload_truncated"] = truncated.into();
    }
    Ok(Json(v))
}

/// The first [`PREVIEW_BYTES`] of `bytes` (fewer when that would cut a UTF-8 character of
/// a text payload) and whether that is less than all of them.
fn preview(bytes: &[u8]) -> (&[u8], bool) {
    if bytes.len() <= PREVIEW_BYTES {
        return (bytes, false);
    }
    let head = &bytes[..PREVIEW_BYTES];
    match std::str::from_utf8(head) {
        // Text cut inside a character: up to the character's start.
        Err(e) if e.error_len().is_none() => (&head[..e.valid_up_to()], true),
        _ => (head, true),
    }
}

/// A dead letter's payload, whole, as a download (`application/octet-stream`, an
/// attachment named after the row id): operator tokens only.
async fn dead_payload(
    State(a): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let r = dead_letter(&a, &caller, &id, true).await?;
    let name = format!("attachment; filename=\"dead-letter-{}.bin\"", r.id);
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (header::CONTENT_DISPOSITION, name),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_owned()),
        ],
        r.payload.unwrap_or_default(),
    )
        .into_response())
}

/// The dead letter `id` names (row id or message id), its payload with `payload` (which
/// needs an operator token): 400 for an id of neither form, 403, 404.
async fn dead_letter(
    a: &Admin,
    caller: &Caller,
    id: &str,
    payload: bool,
) -> Result<outbox::store::DeadLetter, ApiError> {
    if id.parse::<i64>().is_err() && uuid::Uuid::parse_str(id).is_err() {
        return Err(ApiError::bad(format!(
            "{id:?} is neither a row id (an integer) nor a message id (a UUID)"
        )));
    }
    if payload && caller.role != Role::Operator {
        return Err(ApiError(
            StatusCode::FORBIDDEN,
            format!(
                "token {:?} is read-only: payloads are shown to operator tokens only",
                caller.name
            ),
        ));
    }
    dead::find_dead_letter(a.store.as_ref(), id, payload)
        .await?
        .ok_or_else(|| {
            ApiError(
                StatusCode::NOT_FOUND,
                format!(
                    "no dead letter with id or message id {id} (a row that is pending, claimed or dispatched is not a dead letter)"
                ),
            )
        })
}

/// A replay or discard: the rows (ids and/or filters), why, and how.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChangeBody {
    /// Row ids (numbers or strings) or message ids.
    #[serde(default)]
    ids: Vec<serde_json::Value>,
    /// Topic pattern.
    topic: Option<String>,
    /// Died within this long (15m) or since this RFC 3339 time.
    since: Option<String>,
    /// Last error contains this text.
    error: Option<String>,
    /// Why (kept in the audit row). Required.
    #[serde(default)]
    reason: String,
    /// Count and sample only.
    #[serde(default)]
    dry_run: bool,
    /// Most rows to change.
    limit: Option<u32>,
    /// Replay only: rows per second.
    rate: Option<f64>,
    /// Change more than 1,000 rows without a limit.
    #[serde(default)]
    yes: bool,
}

async fn replay(
    State(a): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    body: Result<Json<ChangeBody>, JsonRejection>,
) -> ApiResult {
    change(&a, &caller, body, ReplayAction::Replay).await
}

async fn discard(
    State(a): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    body: Result<Json<ChangeBody>, JsonRejection>,
) -> ApiResult {
    change(&a, &caller, body, ReplayAction::Discard).await
}

/// Replays or discards: the CLI's checks (`change_request`), a dry run first (named
/// rows that are not dead refuse the whole request; more than 1,000 rows need `limit` or
/// `yes`), then the change, audited with the caller's token name as who.
async fn change(
    a: &Admin,
    caller: &Caller,
    body: Result<Json<ChangeBody>, JsonRejection>,
    action: ReplayAction,
) -> ApiResult {
    let Json(body) = body.map_err(|e| ApiError::body(&e))?;
    if body.rate.is_some() && action != ReplayAction::Replay {
        return Err(ApiError::bad("rate applies to a replay only"));
    }
    let ids = body
        .ids
        .iter()
        .map(|v| match v {
            serde_json::Value::String(s) => Ok(s.clone()),
            serde_json::Value::Number(n) => Ok(n.to_string()),
            other => Err(ApiError::bad(format!(
                "ids: {other} is neither a row id nor a message id"
            ))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let filter = Filter {
        ids,
        topic: body.topic,
        since: body.since,
        error: body.error,
    };
    let mut request = change_request(
        filter.selector()?,
        action,
        ChangeText {
            reason: &body.reason,
            by: &caller.name,
            names: ("ids, topic, since or error", "reason", "by"),
        },
        body.limit,
        body.rate,
    )
    .map_err(|e| ApiError::bad(format!("{e:#}")))?;
    if request.limit == Some(0) {
        return Err(ApiError::bad("limit must be at least 1"));
    }
    let preview = a.store.replay(&request).await?;
    if !preview.refused.is_empty() {
        let list: Vec<String> = preview
            .refused
            .iter()
            .map(|r| format!("{}: {}", r.what, r.reason))
            .collect();
        return Err(ApiError(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "refused, nothing changed: {} (only dead letters can be {})",
                list.join("; "),
                past(action)
            ),
        ));
    }
    if body.dry_run {
        return Ok(Json(
            serde_json::to_value(&preview).map_err(anyhow::Error::from)?,
        ));
    }
    if preview.count > CONFIRM_ABOVE && request.limit.is_none() && !body.yes {
        return Err(ApiError::bad(format!(
            "{} match: send a limit, or yes: true to {} them all",
            counted(preview.count, "dead row"),
            action.as_str()
        )));
    }
    request.dry_run = false;
    let done = a.store.replay(&request).await?;
    tracing::info!(by = %caller.name, action = action.as_str(), rows = done.count, audit_id = ?done.replay_id, "admin API: dead letters changed");
    Ok(Json(
        serde_json::to_value(&done).map_err(anyhow::Error::from)?,
    ))
}

fn past(action: ReplayAction) -> &'static str {
    match action {
        ReplayAction::Replay => "replayed",
        ReplayAction::Discard | ReplayAction::Purge => "discarded",
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitQuery {
    limit: Option<u32>,
}

/// The audit of replays, discards and purges, newest first.
async fn replays(
    State(a): State<Arc<Admin>>,
    q: Result<Query<LimitQuery>, QueryRejection>,
) -> ApiResult {
    let Query(q) = q.map_err(|e| ApiError::bad(e.body_text()))?;
    let rows = a
        .store
        .replays(q.limit.unwrap_or(50).clamp(1, MAX_PAGE))
        .await?;
    Ok(Json(serde_json::json!({ "rows": rows })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    /// A topic pattern; absent: every topic (the pause switch).
    topic: Option<String>,
    /// Why. Required.
    #[serde(default)]
    reason: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeBody {
    /// The topic pattern exactly as paused; absent: the pause switch.
    topic: Option<String>,
    /// Why (kept in the audit; optional).
    #[serde(default)]
    reason: String,
}

/// Pauses every topic or the topics matching `topic`, as the caller.
async fn pause(
    State(a): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    body: Result<Json<PauseBody>, JsonRejection>,
) -> ApiResult {
    let Json(body) = body.map_err(|e| ApiError::body(&e))?;
    if body.reason.trim().is_empty() {
        return Err(ApiError::bad(
            "reason must not be empty: relays log it and status shows it",
        ));
    }
    let topic = body.topic.as_deref().filter(|t| !t.trim().is_empty());
    if let Some(t) = topic {
        outbox::sink::router::TopicPattern::parse(t).map_err(ApiError::bad)?;
    }
    let message =
        crate::cmd::pause::pause(a.store.as_ref(), topic, &body.reason, &caller.name).await?;
    tracing::info!(by = %caller.name, topics = topic.unwrap_or("all"), "admin API: paused");
    Ok(Json(serde_json::json!({ "message": message })))
}

/// Lifts the pause switch or one topic pause.
async fn resume(
    State(a): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    body: Result<Json<ResumeBody>, JsonRejection>,
) -> ApiResult {
    let Json(body) = body.map_err(|e| ApiError::body(&e))?;
    let topic = body.topic.as_deref().filter(|t| !t.trim().is_empty());
    let message = crate::cmd::resume::resume(a.store.as_ref(), topic, &body.reason, &caller.name)
        .await
        .map_err(|e| ApiError(StatusCode::NOT_FOUND, format!("{e:#}")))?;
    tracing::info!(by = %caller.name, topics = topic.unwrap_or("all"), "admin API: resumed");
    Ok(Json(serde_json::json!({ "message": message })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MessagesQuery {
    /// A message id (UUID), or else a key.
    q: String,
    /// With a key: only this topic.
    topic: Option<String>,
    limit: Option<u32>,
}

/// Where messages are now: by message id when `q` is a UUID, else by key (in `topic`
/// when given).
async fn messages(
    State(a): State<Arc<Admin>>,
    q: Result<Query<MessagesQuery>, QueryRejection>,
) -> ApiResult {
    let Query(q) = q.map_err(|e| ApiError::bad(e.body_text()))?;
    let text = q.q.trim();
    if text.is_empty() {
        return Err(ApiError::bad("q: give a message id (UUID) or a key"));
    }
    let query = match uuid::Uuid::parse_str(text) {
        Ok(id) => MessageQuery::MessageId(id),
        Err(_) => MessageQuery::Key {
            key: text.to_owned(),
            topic: q.topic.filter(|t| !t.trim().is_empty()),
        },
    };
    let rows = a
        .store
        .find_messages(&query, q.limit.unwrap_or(50).clamp(1, MAX_PAGE))
        .await?;
    let by = match query {
        MessageQuery::MessageId(_) => "message_id",
        MessageQuery::Key { .. } => "key",
    };
    let mut rows = serde_json::to_value(rows).map_err(anyhow::Error::from)?;
    for row in rows.as_array_mut().into_iter().flatten() {
        // A dispatched row's available_at is where its last lease ended, after its
        // dispatched_at: no time of its own, so none is shown.
        if row["status"] == "dispatched" {
            row["available_at"] = serde_json::Value::Null;
        }
    }
    Ok(Json(serde_json::json!({ "by": by, "rows": rows })))
}
