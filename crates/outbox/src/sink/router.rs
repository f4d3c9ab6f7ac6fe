//! Routing and destination health: the one place that decides what a destination's
//! failures mean. The relay always publishes through a [`Router`]: a single sink is a
//! router with one catch-all route ([`Router::single`]).
//!
//! Each batch is split by the first route whose pattern matches the topic; the groups go
//! to their destinations concurrently, each bounded by the publish timeout.
//!
//! Patterns ([`TopicPattern`], defined in [`crate::topic`]) are NATS-style over dotted
//! topics: a token matches itself, `*` matches exactly one token, `>` (last) matches one
//! or more tokens. `orders.*` matches `orders.placed`, not `orders.placed.v1`; `orders.>`
//! matches both; `>` matches everything.
//!
//! A topic no route matches is a permanent error that names the topic ("no route for
//! topic …"): the message is quarantined, never dropped.
//!
//! Health, per destination:
//! - **Timeouts are judged here.** A message with no confirmation within the timeout
//!   ([`ErrorKind::TimedOut`], whether the sink's own timeout or the router's) is the
//!   message's fault when the destination confirmed any other message since this group
//!   was sent (it becomes [`ErrorKind::Transient`]: an attempt counts, and it is
//!   quarantined eventually with a reason saying it timed out). When the destination
//!   confirmed nothing, what counts is whether the message reached it:
//!   - **sent** (the sink's [`PublishError::timed_out_after_send`], or a slot the sink
//!     marked with [`Confirmations::mark_sent`]): the destination took it and did not
//!     answer in time, which is slowness, not an outage. The message's first
//!     [`TIMEOUT_REFUNDS`] such timeouts give the attempt back (a destination that
//!     accepts connections and hangs for a moment costs nothing); from then on each one
//!     counts an attempt, with the reason "timed out after the request was sent" and the
//!     hint to raise the publish timeout, so the message is quarantined at `max_attempts`
//!     instead of being sent again without bound. It does not open the breaker (the
//!     destination is reachable). Counted in `outbox_publish_timeouts_total` and logged
//!     (WARN, at most once a minute per destination, with the hint).
//!   - **not known to be sent** (the sink says nothing about it): an outage
//!     ([`ErrorKind::Unavailable`]), the attempt given back, however often.
//!
//!   The refunds are counted per message in this router's memory (a restart, or another
//!   relay, starts again from zero; bounded, see [`TIMEOUT_REFUNDS`]).
//! - **One copy in flight.** A sink that keeps a timed-out request running to its own
//!   bound answers a second publish of the same message meanwhile with an
//!   [`ErrorKind::Unavailable`] of code [`super::IN_FLIGHT`] (nothing is sent): it is
//!   neutral for the breaker (neither reachable nor down).
//! - **A circuit breaker.** A group in which every message found the destination
//!   unavailable opens the destination's breaker (after `failure_threshold` such groups
//!   in a row) for `open_base`, doubling per failed probe up to `open_max` (a longer
//!   `retry_after` from the destination, such as HTTP `Retry-After`, delays the messages
//!   that got it, never the breaker past `open_max`).
//!   While open, its messages get [`ErrorKind::Unavailable`] at once, without a publish,
//!   with `retry_after` = the rest of the open period: the relay reschedules them for
//!   then and gives their attempt back. When every destination is open the relay stops
//!   claiming until the first probe is due ([`Router::all_open_for`]). After the open
//!   period the next group is the probe: any confirmation closes the breaker and delivery
//!   resumes at full speed at once.
//! - A destination that answers (a confirmation, or a refusal about the message) is
//!   healthy; only "could not reach it" counts towards opening.

use super::{Confirmations, ErrorKind, PublishCode, PublishError, Sink, SinkError};
use crate::message::OutgoingMessage;
use futures::future::join_all;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

pub use crate::topic::{MAX_PATTERN_BYTES, MAX_PATTERN_TOKENS, TopicPattern};

/// How many timeouts after sending (the destination confirmed nothing meanwhile) give one
/// message its attempt back; later ones count (see the module docs). So a message is sent
/// at most `TIMEOUT_REFUNDS + max_attempts` times by one relay to a destination that
/// takes it and never answers in time.
pub const TIMEOUT_REFUNDS: u32 = 3;

/// Messages whose refunded timeouts one destination remembers; past this the memory is
/// cleared (which gives some messages a few more refunds, never unbounded ones while
/// fewer messages than this are timing out).
const TIMEOUT_MEMORY: usize = 100_000;

/// The shortest interval between two "timed out after sending" warnings of one
/// destination.
const SLOW_WARNING_INTERVAL: Duration = Duration::from_secs(60);

/// Settings of a [`Router`]'s circuit breakers.
#[derive(Debug, Clone)]
pub struct RouterOptions {
    /// Groups in a row that found a destination unavailable before its breaker opens
    /// (default 1).
    pub failure_threshold: u32,
    /// First open period (default 500 ms); doubles after each failed probe.
    pub open_base: Duration,
    /// Longest open period (default 2 s): after an outage ends, the longest a destination
    /// waits for its next probe, so a backlog resumes within about this long of the
    /// broker's return (plus the sink's reconnect).
    pub open_max: Duration,
}

impl Default for RouterOptions {
    fn default() -> Self {
        RouterOptions {
            failure_threshold: 1,
            open_base: Duration::from_millis(500),
            open_max: Duration::from_secs(2),
        }
    }
}

/// The state of one destination's circuit breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Publishing; `failures` consecutive unavailable groups so far.
    Closed {
        /// Consecutive unavailable groups.
        failures: u32,
    },
    /// Not publishing until `until`.
    Open {
        /// When the next probe may go.
        until: Instant,
        /// The open period that led here (doubles per failed probe).
        period: Duration,
    },
}

struct Health {
    breaker: BreakerState,
    /// The last time this destination confirmed a message.
    last_confirmed: Option<Instant>,
    /// When the current outage began (for the recovery log line).
    down_since: Option<Instant>,
    /// Per message id: its timeouts after sending whose attempt was given back.
    refunded_timeouts: std::collections::HashMap<uuid::Uuid, u32>,
    /// When the last "timed out after sending" warning was logged.
    slow_warned: Option<Instant>,
    /// Timeouts after sending since then.
    slow_unwarned: u64,
}

struct Route {
    pattern: TopicPattern,
    sink: Arc<dyn Sink>,
    /// Index into `Router::health`: routes naming the same sink share one health.
    health: usize,
}

/// Topic routes over destinations, with each destination's health (see the module docs).
pub struct Router {
    routes: Vec<Route>,
    health: Vec<(Arc<dyn Sink>, Mutex<Health>)>,
    /// Per destination: its metrics label (the redacted description) and messaging system.
    labels: Vec<(String, &'static str)>,
    options: RouterOptions,
}

impl std::fmt::Debug for Router {
    /// Each route's pattern and its destination's label (the redacted description).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let routes: Vec<_> = self
            .routes
            .iter()
            .map(|r| {
                (
                    &r.pattern,
                    self.labels.get(r.health).map(|(label, _)| label),
                )
            })
            .collect();
        f.debug_struct("Router")
            .field("routes", &routes)
            .finish_non_exhaustive()
    }
}

impl From<Arc<dyn Sink>> for Router {
    fn from(sink: Arc<dyn Sink>) -> Self {
        Router::single(sink)
    }
}

impl From<Box<dyn Sink>> for Router {
    fn from(sink: Box<dyn Sink>) -> Self {
        Router::single(Arc::from(sink))
    }
}

/// Builds a [`Router`] ([`Router::builder`]).
#[derive(Default)]
pub struct RouterBuilder {
    routes: Vec<(String, Arc<dyn Sink>)>,
    options: RouterOptions,
}

impl RouterBuilder {
    /// Topics matching `pattern` (a [`TopicPattern`]: `orders.*`, `orders.>`, `>`) go to
    /// `sink`. Routes given the same `Arc` share one destination (one breaker).
    #[must_use]
    pub fn route(mut self, pattern: &str, sink: Arc<dyn Sink>) -> Self {
        self.routes.push((pattern.to_owned(), sink));
        self
    }

    /// Topics matching `pattern` run through `handler` in this process: a
    /// [`crate::job::Handler`] (any [`Sink`] value is taken, as [`RouterBuilder::route`]
    /// takes one behind an `Arc`).
    #[must_use]
    pub fn handle(self, pattern: &str, handler: impl Sink) -> Self {
        self.route(pattern, Arc::new(handler))
    }

    /// Breaker settings (default [`RouterOptions::default`]).
    #[must_use]
    pub fn options(mut self, options: RouterOptions) -> Self {
        self.options = options;
        self
    }

    /// The router.
    ///
    /// # Errors
    /// [`SinkError::InvalidPattern`] for a pattern [`TopicPattern::parse`] refuses, or no
    /// route at all.
    pub fn build(self) -> Result<Router, SinkError> {
        if self.routes.is_empty() {
            return Err(SinkError::InvalidPattern {
                pattern: String::new(),
                reason: "a router needs at least one route".to_owned(),
            });
        }
        let mut routes = Vec::with_capacity(self.routes.len());
        for (pattern, sink) in self.routes {
            let p = TopicPattern::parse(&pattern)
                .map_err(|reason| SinkError::InvalidPattern { pattern, reason })?;
            routes.push((p, sink));
        }
        Ok(Router::new(routes, self.options))
    }
}

impl std::fmt::Debug for RouterBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let routes: Vec<(&str, String)> = self
            .routes
            .iter()
            .map(|(p, s)| (p.as_str(), s.describe()))
            .collect();
        f.debug_struct("RouterBuilder")
            .field("routes", &routes)
            .field("options", &self.options)
            .finish()
    }
}

impl Router {
    /// A router over `routes`, tried in order (first match wins). Routes given the same
    /// `Arc` share one destination (one breaker).
    pub fn new(routes: Vec<(TopicPattern, Arc<dyn Sink>)>, options: RouterOptions) -> Self {
        let mut health: Vec<(Arc<dyn Sink>, Mutex<Health>)> = Vec::new();
        let routes = routes
            .into_iter()
            .map(|(pattern, sink)| {
                let h = match health.iter().position(|(s, _)| Arc::ptr_eq(s, &sink)) {
                    Some(h) => h,
                    None => {
                        health.push((
                            sink.clone(),
                            Mutex::new(Health {
                                breaker: BreakerState::Closed { failures: 0 },
                                last_confirmed: None,
                                down_since: None,
                                refunded_timeouts: Default::default(),
                                slow_warned: None,
                                slow_unwarned: 0,
                            }),
                        ));
                        health.len() - 1
                    }
                };
                Route {
                    pattern,
                    sink,
                    health: h,
                }
            })
            .collect();
        let labels = health
            .iter()
            .map(|(s, _)| {
                let d = s.describe();
                let system = crate::metrics::system_of(&d);
                (d, system)
            })
            .collect();
        Router {
            routes,
            health,
            labels,
            options,
        }
    }

    /// A router built route by route: brokers' sinks ([`RouterBuilder::route`]) and job
    /// handlers ([`RouterBuilder::handle`]), tried in the order given.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), outbox::sink::SinkError> {
    /// use outbox::job::{Handler, Job, JobError};
    /// use outbox::sink::router::Router;
    /// use std::sync::Arc;
    ///
    /// let nats = Arc::from(outbox::sink::open("nats://127.0.0.1:4222").await?);
    /// let router = Router::builder()
    ///     .handle("emails.>", Handler::new("send_email", |job: Job| async move {
    ///         let _ = job.payload; // … send it
    ///         Ok::<(), JobError>(())
    ///     }))
    ///     .route("orders.>", nats)
    ///     .build()?;
    /// # let _ = router; Ok(()) }
    /// ```
    pub fn builder() -> RouterBuilder {
        RouterBuilder::default()
    }

    /// Every topic to `sink`, with default breaker settings.
    pub fn single(sink: Arc<dyn Sink>) -> Self {
        Router::new(
            vec![(TopicPattern::everything(), sink)],
            RouterOptions::default(),
        )
    }

    /// The same routes with other breaker settings.
    #[must_use]
    pub fn with_options(mut self, options: RouterOptions) -> Self {
        self.options = options;
        self
    }

    /// Opens the sink of every `(pattern, url)` route with [`super::open`]; routes naming
    /// the same URL share one sink (one connection, one breaker).
    ///
    /// # Errors
    /// [`SinkError::InvalidUrl`] for a bad pattern or URL, or the sink's own error.
    pub async fn open(
        routes: &[(String, String)],
        options: RouterOptions,
    ) -> Result<Self, SinkError> {
        let mut opened: Vec<(String, Arc<dyn Sink>)> = Vec::new();
        let mut out = Vec::with_capacity(routes.len());
        for (pattern, url) in routes {
            let p = TopicPattern::parse(pattern).map_err(|reason| SinkError::InvalidUrl {
                url: crate::redact::redact_url(url),
                reason,
            })?;
            let sink = match opened.iter().find(|(u, _)| u == url) {
                Some((_, s)) => s.clone(),
                None => {
                    let s: Arc<dyn Sink> = Arc::from(super::open(url).await?);
                    opened.push((url.clone(), s.clone()));
                    s
                }
            };
            out.push((p, sink));
        }
        Ok(Router::new(out, options))
    }

    /// The breaker state of each route, in route order (for status and tests).
    pub fn breakers(&self) -> Vec<(String, BreakerState)> {
        self.routes
            .iter()
            .map(|r| (r.pattern.as_str().to_owned(), self.lock(r.health).breaker))
            .collect()
    }

    /// `Some(wait)` when every destination's breaker is open: nothing claimed now could
    /// be published before `wait` has passed (the soonest probe). `None` when some
    /// destination may be published to.
    pub fn all_open_for(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut soonest: Option<Duration> = None;
        for i in 0..self.health.len() {
            match self.lock(i).breaker {
                BreakerState::Open { until, .. } if until > now => {
                    let rest = until - now;
                    soonest = Some(soonest.map_or(rest, |s| s.min(rest)));
                }
                _ => return None,
            }
        }
        soonest
    }

    /// A description for logs: the routes and their destinations (no secrets).
    pub fn describe(&self) -> String {
        match self.routes.as_slice() {
            [only] if only.pattern.as_str() == ">" => only.sink.describe(),
            routes => {
                let routes: Vec<String> = routes
                    .iter()
                    .map(|r| format!("{}={}", r.pattern.as_str(), r.sink.describe()))
                    .collect();
                format!("router({})", routes.join(", "))
            }
        }
    }

    /// Closes every destination once.
    pub async fn close(&self) {
        join_all(self.health.iter().map(|(s, _)| s.close())).await;
    }

    fn lock(&self, health: usize) -> std::sync::MutexGuard<'_, Health> {
        self.health[health]
            .1
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn route_of(&self, topic: &str) -> Option<usize> {
        self.routes.iter().position(|r| r.pattern.matches(topic))
    }

    /// The messaging system (`kafka`, `rabbitmq`, `nats`, …) of the destination `topic`
    /// is routed to; `none` when no route matches.
    pub(crate) fn system_of(&self, topic: &str) -> &'static str {
        self.route_of(topic)
            .map_or("none", |r| self.labels[self.routes[r].health].1)
    }

    /// Publishes `batch`, recording each message's outcome in `confirm` (slot `i` is
    /// `batch[i]`); every destination's group is bounded by `timeout`. When it returns,
    /// every slot is filled. Dropping the future early keeps what was recorded.
    pub async fn publish(
        &self,
        batch: &[OutgoingMessage],
        confirm: &Confirmations,
        timeout: Duration,
    ) {
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); self.health.len()];
        for (i, m) in batch.iter().enumerate() {
            match self.route_of(&m.topic) {
                Some(r) => groups[self.routes[r].health].push(i),
                None => {
                    confirm.set(
                        i,
                        Err(PublishError::permanent(format!(
                            "no route for topic {:?}: add a --route whose pattern matches it, or a catch-all --sink",
                            m.topic
                        ))
                        .with_code(PublishCode::NoRoute)),
                    );
                    crate::metrics::publish("none", "none", "permanent", "no_route", 1);
                }
            }
        }
        join_all(
            groups
                .into_iter()
                .enumerate()
                .filter(|(_, idx)| !idx.is_empty())
                .map(|(h, idx)| async move {
                    // The whole batch to one destination (every single-sink relay): no
                    // copy of the messages, no view.
                    if idx.len() == batch.len() {
                        return self.publish_group(h, batch, confirm, timeout).await;
                    }
                    let msgs: Vec<OutgoingMessage> =
                        idx.iter().map(|&i| batch[i].clone()).collect();
                    let sub = confirm.subset(&idx);
                    self.publish_group(h, &msgs, &sub, timeout).await;
                }),
        )
        .await;
    }

    async fn publish_group(
        &self,
        h: usize,
        msgs: &[OutgoingMessage],
        confirm: &Confirmations,
        timeout: Duration,
    ) {
        let sink = &self.health[h].0;
        let now = Instant::now();
        if let BreakerState::Open { until, .. } = self.lock(h).breaker
            && until > now
        {
            let rest = until - now;
            confirm.fail_unset(
                &PublishError::unavailable(format!(
                    "circuit open for {}: not publishing for another {rest:?}",
                    sink.describe()
                ))
                .with_retry_after(rest)
                .with_code(PublishCode::BreakerOpen),
            );
            self.count_outcomes(h, confirm, now);
            return;
        }
        let sent = Instant::now();
        let timeout = sink.publish_timeout(timeout);
        // Done when the sink returns, or as soon as every message has its outcome (a sink
        // may still be tidying up), or at the timeout.
        let finished = tokio::time::timeout(timeout, async {
            tokio::select! {
                () = sink.publish(msgs, confirm) => {}
                () = confirm.complete() => {}
            }
        })
        .await
        .is_ok();
        if finished {
            confirm.fail_unset(
                &PublishError::transient(format!(
                    "{} returned without an outcome for this message",
                    sink.describe()
                ))
                .with_code(PublishCode::NoOutcome),
            );
        } else {
            confirm.fail_unset(&PublishError::timed_out(format!(
                "no confirmation from {} within {timeout:?}",
                sink.describe()
            )));
        }
        let confirmed = confirm.confirmed();
        let mut health = self.lock(h);
        if confirmed > 0 {
            health.last_confirmed = Some(Instant::now());
        }
        // Did the destination confirm anything since this group was sent (this group, or
        // another batch meanwhile)? Then a timeout here is about the message.
        let alive = health.last_confirmed.is_some_and(|t| t >= sent);
        let sent_marks: Vec<bool> = (0..msgs.len()).map(|i| confirm.was_sent(i)).collect();
        if health.refunded_timeouts.len() > TIMEOUT_MEMORY {
            health.refunded_timeouts.clear();
        }
        let mut unavailable = 0;
        let mut answered = false;
        let mut retry_after: Option<Duration> = None;
        // Timeouts by `outbox_publish_timeouts_total` outcome.
        let (mut after_send, mut after_send_refunded, mut counted, mut outage) = (0, 0, 0, 0);
        let mut j = 0;
        confirm.update_each(|slot, _| {
            let (id, was_sent) = (msgs[j].message_id, sent_marks[j]);
            j += 1;
            match slot {
                Some(Err(e)) if e.kind == ErrorKind::TimedOut => {
                    if e.is_timeout_after_send() || was_sent {
                        // Reachable: it took the message. Slow, not down.
                        answered = true;
                        let refunds = health.refunded_timeouts.entry(id).or_insert(0);
                        if !alive && *refunds < TIMEOUT_REFUNDS {
                            *refunds += 1;
                            after_send_refunded += 1;
                            *slot = Some(Err(PublishError::unavailable(format!(
                                "timed out after the request was sent: {} (the destination confirmed nothing; attempt given back, {} of {TIMEOUT_REFUNDS} for this message)",
                                e.message, *refunds
                            ))
                            .with_code(PublishCode::TimedOutAfterSend)));
                        } else {
                            after_send += 1;
                            *slot = Some(Err(PublishError::transient(format!(
                                "timed out after the request was sent: {} (the destination took it and did not answer in time; {})",
                                e.message,
                                sink.slow_hint()
                            ))
                            .with_code(PublishCode::TimedOutAfterSend)));
                        }
                    } else if alive {
                        answered = true;
                        counted += 1;
                        *slot = Some(Err(PublishError::transient(format!(
                            "timed out: {} (the destination confirmed other messages meanwhile)",
                            e.message
                        ))
                        .with_code(PublishCode::Timeout)));
                    } else {
                        unavailable += 1;
                        outage += 1;
                        *slot = Some(Err(PublishError::unavailable(format!(
                            "{} (the destination confirmed nothing)",
                            e.message
                        ))
                        .with_code(PublishCode::Timeout)));
                    }
                }
                // Nothing sent: says nothing about the destination's health.
                Some(Err(e))
                    if e.kind == ErrorKind::Unavailable
                        && matches!(e.code, PublishCode::InFlight | PublishCode::NotStarted) => {}
                Some(Err(e)) if e.kind == ErrorKind::Unavailable => {
                    unavailable += 1;
                    retry_after = retry_after.max(e.retry_after);
                }
                _ => {
                    answered = true;
                    if !health.refunded_timeouts.is_empty() {
                        health.refunded_timeouts.remove(&id);
                    }
                }
            }
        });
        let slow = after_send + after_send_refunded;
        if slow > 0 {
            health.slow_unwarned += slow;
            if health
                .slow_warned
                .is_none_or(|t| t.elapsed() >= SLOW_WARNING_INTERVAL)
            {
                tracing::warn!(
                    destination = %sink.describe(),
                    timed_out = health.slow_unwarned,
                    timeout = ?timeout,
                    hint = %sink.slow_hint(),
                    "messages were sent and not answered within the publish timeout: the destination is reachable but slow (not an outage); each message is sent once at a time and, after {TIMEOUT_REFUNDS} such timeouts, counts attempts"
                );
                health.slow_warned = Some(Instant::now());
                health.slow_unwarned = 0;
            }
        }
        let label = &self.labels[h].0;
        for (outcome, n) in [
            ("timed_out_after_send", after_send),
            ("timed_out_after_send_refunded", after_send_refunded),
            ("timed_out", counted),
            ("timed_out_outage", outage),
        ] {
            crate::metrics::publish_timeouts(label, outcome, n);
        }
        if !answered && unavailable == 0 {
            // Only messages still in flight: the breaker stays as it is.
            drop(health);
            self.count_outcomes(h, confirm, sent);
            return;
        }
        let down = !answered && unavailable > 0;
        let o = &self.options;
        let describe = || sink.describe();
        health.breaker = match (health.breaker, down) {
            (_, false) => {
                if let Some(since) = health.down_since.take() {
                    tracing::info!(destination = %describe(), outage = ?since.elapsed(), "destination reachable again: circuit closed");
                }
                BreakerState::Closed { failures: 0 }
            }
            (BreakerState::Closed { failures }, true) if failures + 1 < o.failure_threshold => {
                BreakerState::Closed {
                    failures: failures + 1,
                }
            }
            (BreakerState::Closed { .. }, true) => {
                // A long Retry-After stays with the messages that got it; the breaker
                // probes again within open_max, so one message's 503 + Retry-After: 60
                // cannot hold the whole destination for a minute.
                let period = o
                    .open_base
                    .max(retry_after.unwrap_or_default())
                    .min(o.open_max);
                health.down_since.get_or_insert(sent);
                tracing::warn!(destination = %describe(), open_for = ?period, "destination unavailable: circuit opened");
                BreakerState::Open {
                    until: Instant::now() + period,
                    period: o.open_base,
                }
            }
            (BreakerState::Open { period, .. }, true) => {
                let period = (period * 2).min(o.open_max);
                tracing::debug!(destination = %describe(), open_for = ?period, "destination still unavailable: circuit stays open");
                BreakerState::Open {
                    until: Instant::now() + period,
                    period,
                }
            }
        };
        // Rows of an open destination come back when its next probe is due (or later,
        // when the destination asked for longer).
        if let BreakerState::Open { until, .. } = health.breaker {
            let rest = until.saturating_duration_since(Instant::now());
            confirm.update_each(|slot, _| {
                if let Some(Err(e)) = slot
                    && e.kind == ErrorKind::Unavailable
                {
                    let after = e.retry_after.unwrap_or_default().max(rest);
                    e.retry_after = Some(after);
                }
            });
        }
        drop(health);
        self.count_outcomes(h, confirm, sent);
    }

    /// Records each message's final outcome of a group (and, when confirmed, its time
    /// since `sent`) in the metrics.
    fn count_outcomes(&self, h: usize, confirm: &Confirmations, sent: Instant) {
        let (label, system) = (&self.labels[h].0, self.labels[h].1);
        let sent = sent.into_std();
        // One metric key per batch for the common outcome (a key per message was a
        // measurable share of the relay's work); failures, rarer, one by one.
        let durations = crate::metrics::confirm_durations(label);
        let mut ok = 0;
        confirm.update_each(|slot, at| match slot {
            Some(Ok(())) => {
                ok += 1;
                if let Some(at) = at {
                    durations.record(at.saturating_duration_since(sent).as_secs_f64());
                }
            }
            Some(Err(e)) => crate::metrics::publish(label, system, e.outcome(), e.code.as_str(), 1),
            None => {}
        });
        if ok > 0 {
            crate::metrics::publish(label, system, "ok", "none", ok);
        }
    }

    /// Each destination and its state for metrics: `up` (closed, no failure since the
    /// last success), `down` (failing, breaker not open yet) or `open`.
    pub fn destination_states(&self) -> Vec<(String, &'static str)> {
        let now = Instant::now();
        (0..self.health.len())
            .map(|h| {
                let state = match self.lock(h).breaker {
                    BreakerState::Open { until, .. } if until > now => "open",
                    BreakerState::Open { .. } => "down",
                    BreakerState::Closed { failures: 0 } => "up",
                    BreakerState::Closed { .. } => "down",
                };
                (self.labels[h].0.clone(), state)
            })
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    fn msg(id: i64, topic: &str) -> OutgoingMessage {
        OutgoingMessage {
            id,
            message_id: uuid::Uuid::now_v7(),
            topic: topic.into(),
            key: None,
            payload: bytes::Bytes::from_static(b"x"),
            headers: BTreeMap::new(),
            occurred_at: chrono::Utc::now(),
            attempts: 1,
        }
    }

    /// Confirms every message at once, except those whose id is in `slow` (never
    /// answered); reports "not connected" while `down`.
    struct Scripted {
        slow: Vec<i64>,
        down: AtomicBool,
        calls: AtomicU32,
    }

    impl Scripted {
        fn new(slow: Vec<i64>) -> Arc<Self> {
            Arc::new(Scripted {
                slow,
                down: AtomicBool::new(false),
                calls: AtomicU32::new(0),
            })
        }
    }

    #[async_trait]
    impl Sink for Scripted {
        async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                confirm.fail_unset(&PublishError::unavailable("not connected"));
                return;
            }
            for (i, m) in batch.iter().enumerate() {
                if !self.slow.contains(&m.id) {
                    confirm.set(i, Ok(()));
                }
            }
            std::future::pending::<()>().await;
        }
        fn describe(&self) -> String {
            "scripted".into()
        }
    }

    fn kinds(c: &Confirmations) -> Vec<Option<ErrorKind>> {
        (0..c.len())
            .map(|i| c.get(i).unwrap().err().map(|e| e.kind))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_message_beside_confirmed_ones_is_its_own_fault() {
        let sink = Scripted::new(vec![3]);
        let router = Router::single(sink.clone());
        let batch: Vec<_> = (1..=5).map(|i| msg(i, "t.v1")).collect();
        let c = Confirmations::new(5);
        let started = Instant::now();
        router.publish(&batch, &c, Duration::from_secs(10)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert_eq!(
            kinds(&c),
            vec![None, None, Some(ErrorKind::Transient), None, None]
        );
        let e = c.get(2).unwrap().unwrap_err();
        assert!(e.message.contains("timed out"), "{e}");
        assert!(matches!(
            router.breakers()[0].1,
            BreakerState::Closed { failures: 0 }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_destination_that_confirms_nothing_is_an_outage_and_opens_its_breaker() {
        let sink = Scripted::new(vec![1, 2]);
        let router = Router::single(sink.clone());
        let batch = vec![msg(1, "t.v1"), msg(2, "t.v1")];
        let c = Confirmations::new(2);
        router.publish(&batch, &c, Duration::from_secs(10)).await;
        assert_eq!(kinds(&c), vec![Some(ErrorKind::Unavailable); 2]);
        // The rows come back when the next probe is due.
        let e = c.get(0).unwrap().unwrap_err();
        assert_eq!(e.retry_after, Some(Duration::from_millis(500)));
        assert_eq!(router.all_open_for(), Some(Duration::from_millis(500)));

        // While open: no publish, Unavailable at once.
        let c = Confirmations::new(1);
        router
            .publish(&batch[..1], &c, Duration::from_secs(10))
            .await;
        assert_eq!(sink.calls.load(Ordering::SeqCst), 1);
        assert_eq!(kinds(&c), vec![Some(ErrorKind::Unavailable)]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_breaker_probes_and_recovery_is_immediate() {
        let sink = Scripted::new(vec![]);
        sink.down.store(true, Ordering::SeqCst);
        let router = Router::single(sink.clone());
        let batch = vec![msg(1, "t.v1")];
        // Failing probes double the open period up to open_max (2 s).
        let mut periods = Vec::new();
        for _ in 0..5 {
            let c = Confirmations::new(1);
            router.publish(&batch, &c, Duration::from_secs(1)).await;
            let wait = router.all_open_for().unwrap();
            periods.push(wait);
            tokio::time::advance(wait).await;
        }
        assert_eq!(
            periods,
            [500, 1000, 2000, 2000, 2000].map(Duration::from_millis)
        );
        // The destination is back: the next probe succeeds and the breaker closes.
        sink.down.store(false, Ordering::SeqCst);
        let c = Confirmations::new(1);
        router.publish(&batch, &c, Duration::from_secs(1)).await;
        assert_eq!(kinds(&c), vec![None]);
        assert_eq!(router.all_open_for(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_destination_does_not_hold_back_a_healthy_one() {
        let healthy = Scripted::new(vec![]);
        let dead = Scripted::new(vec![]);
        dead.down.store(true, Ordering::SeqCst);
        let router = Router::new(
            vec![
                (
                    TopicPattern::parse("a.>").unwrap(),
                    healthy.clone() as Arc<dyn Sink>,
                ),
                (
                    TopicPattern::parse("b.>").unwrap(),
                    dead.clone() as Arc<dyn Sink>,
                ),
            ],
            RouterOptions::default(),
        );
        let batch = vec![msg(1, "a.x"), msg(2, "b.x"), msg(3, "c.x")];
        let c = Confirmations::new(3);
        let started = Instant::now();
        router.publish(&batch, &c, Duration::from_secs(10)).await;
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(
            kinds(&c),
            vec![
                None,
                Some(ErrorKind::Unavailable),
                Some(ErrorKind::Permanent)
            ]
        );
        assert!(c.get(2).unwrap().unwrap_err().message.contains("no route"));
        // Only the dead destination's breaker is open, so the relay keeps claiming.
        assert_eq!(router.all_open_for(), None);
    }

    /// Takes every message (marks it sent) and never answers.
    struct Hanging;

    #[async_trait]
    impl Sink for Hanging {
        async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
            for i in 0..batch.len() {
                confirm.mark_sent(i);
            }
            std::future::pending::<()>().await;
        }
        fn describe(&self) -> String {
            "hanging".into()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_after_sending_is_given_back_a_few_times_then_counted() {
        let router = Router::single(Arc::new(Hanging));
        let batch = vec![msg(1, "t.v1")];
        let mut seen = Vec::new();
        for _ in 0..TIMEOUT_REFUNDS + 2 {
            let c = Confirmations::new(1);
            router.publish(&batch, &c, Duration::from_millis(300)).await;
            let e = c.get(0).unwrap().unwrap_err();
            assert_eq!(e.code, crate::sink::TIMED_OUT_AFTER_SEND, "{e}");
            assert!(
                e.message.contains("timed out after the request was sent"),
                "{e}"
            );
            seen.push(e.kind);
            // Reachable, only slow: the breaker never opens.
            assert_eq!(router.all_open_for(), None);
        }
        let refunds = TIMEOUT_REFUNDS as usize;
        assert_eq!(seen[..refunds], vec![ErrorKind::Unavailable; refunds]);
        assert_eq!(seen[refunds..], [ErrorKind::Transient; 2]);
        // Another message starts with its own refunds.
        let c = Confirmations::new(1);
        router
            .publish(&[msg(2, "t.v1")], &c, Duration::from_millis(300))
            .await;
        assert_eq!(kinds(&c), vec![Some(ErrorKind::Unavailable)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_not_known_to_be_sent_stays_an_outage() {
        let sink = Scripted::new(vec![1]);
        let router = Router::single(sink.clone());
        let batch = vec![msg(1, "t.v1")];
        for _ in 0..TIMEOUT_REFUNDS + 2 {
            let c = Confirmations::new(1);
            router.publish(&batch, &c, Duration::from_millis(300)).await;
            assert_eq!(kinds(&c), vec![Some(ErrorKind::Unavailable)]);
            tokio::time::advance(router.all_open_for().unwrap()).await;
        }
    }

    /// Refuses every message as still in flight.
    struct StillInFlight;

    #[async_trait]
    impl Sink for StillInFlight {
        async fn publish(&self, _batch: &[OutgoingMessage], confirm: &Confirmations) {
            confirm.fail_unset(
                &PublishError::unavailable("an earlier request is still outstanding")
                    .with_code(PublishCode::InFlight)
                    .with_retry_after(Duration::from_millis(700)),
            );
        }
        fn describe(&self) -> String {
            "in flight".into()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_still_in_flight_leaves_the_breaker_alone() {
        let router = Router::single(Arc::new(StillInFlight));
        let c = Confirmations::new(1);
        router
            .publish(&[msg(1, "t.v1")], &c, Duration::from_secs(1))
            .await;
        let e = c.get(0).unwrap().unwrap_err();
        assert_eq!(
            (e.kind, e.retry_after),
            (ErrorKind::Unavailable, Some(Duration::from_millis(700)))
        );
        assert!(matches!(
            router.breakers()[0].1,
            BreakerState::Closed { failures: 0 }
        ));
    }

    /// Answers "503, Retry-After: 60" to everything.
    struct Throttled;

    #[async_trait]
    impl Sink for Throttled {
        async fn publish(&self, _batch: &[OutgoingMessage], confirm: &Confirmations) {
            confirm.fail_unset(
                &PublishError::unavailable("HTTP 503").with_retry_after(Duration::from_secs(60)),
            );
        }
        fn describe(&self) -> String {
            "throttled".into()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_retry_after_delays_its_messages_not_the_breaker() {
        let router = Router::single(Arc::new(Throttled));
        let batch = vec![msg(1, "t.v1")];
        let c = Confirmations::new(1);
        router.publish(&batch, &c, Duration::from_secs(1)).await;
        let e = c.get(0).unwrap().unwrap_err();
        assert_eq!(e.retry_after, Some(Duration::from_secs(60)));
        assert_eq!(router.all_open_for(), Some(Duration::from_secs(2)));
    }

    /// A sink that returns without recording some outcomes can never have them count as
    /// confirmed.
    struct Forgetful;

    #[async_trait]
    impl Sink for Forgetful {
        async fn publish(&self, _batch: &[OutgoingMessage], confirm: &Confirmations) {
            confirm.set(0, Ok(()));
        }
        fn describe(&self) -> String {
            "forgetful".into()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_missing_outcome_is_never_success() {
        let router = Router::single(Arc::new(Forgetful));
        let batch = vec![msg(1, "t.v1"), msg(2, "t.v1")];
        let c = Confirmations::new(2);
        router.publish(&batch, &c, Duration::from_secs(1)).await;
        assert_eq!(kinds(&c), vec![None, Some(ErrorKind::Transient)]);
    }

    #[test]
    fn a_slot_keeps_its_first_outcome() {
        let c = Confirmations::new(2);
        assert!(c.set(0, Ok(())));
        assert!(!c.set(0, Err(PublishError::permanent("late"))));
        assert!(!c.set(5, Ok(())));
        let sub = c.subset(&[1]);
        assert!(sub.set(0, Err(PublishError::permanent("no"))));
        assert_eq!(c.confirmed(), 1);
        assert!(matches!(c.get(1), Some(Err(_))));
    }
}
