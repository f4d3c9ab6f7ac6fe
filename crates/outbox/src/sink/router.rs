//! Routing: one relay, several destinations. A [`Router`] is itself a [`Sink`]: it splits
//! each batch by the first route whose pattern matches the topic, publishes the groups to
//! their destinations concurrently, and isolates the destinations from one another with a
//! timeout and a circuit breaker each.
//!
//! Patterns are NATS-style over dotted topics: a token matches itself, `*` matches exactly
//! one token, `>` (last) matches one or more tokens. `orders.*` matches `orders.placed`,
//! not `orders.placed.v1`; `orders.>` matches both; `>` matches everything.
//!
//! A topic no route matches is a permanent error that names the topic ("no route for
//! topic …"): the message is quarantined, never dropped.
//!
//! The circuit breaker of a destination opens after `failure_threshold` consecutive
//! batches that found it unavailable (every message `Unavailable`, or the route's timeout
//! passed). While open, its messages get [`ErrorKind::Unavailable`] at once, without a
//! publish attempt, with `retry_after` = the rest of the open period: the relay reschedules
//! them and gives their attempt back, so an outage never quarantines healthy messages and
//! never slows the other destinations. After the open period one batch goes through as a
//! probe: success closes the breaker, failure opens it again for twice as long (capped).

use super::{ErrorKind, PublishError, Sink, SinkError};
use crate::message::OutgoingMessage;
use async_trait::async_trait;
use futures::future::join_all;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A topic pattern (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicPattern {
    text: String,
    tokens: Vec<String>,
}

impl TopicPattern {
    /// Parses `pattern`.
    ///
    /// # Errors
    /// A message when a token is empty, or `>` is not the last token, or a token mixes a
    /// wildcard with other characters.
    pub fn parse(pattern: &str) -> Result<Self, String> {
        let tokens: Vec<String> = pattern.split('.').map(str::to_owned).collect();
        for (i, t) in tokens.iter().enumerate() {
            if t.is_empty() {
                return Err(format!("route pattern {pattern:?} has an empty token"));
            }
            if t == ">" && i + 1 != tokens.len() {
                return Err(format!(
                    "route pattern {pattern:?}: `>` must be the last token"
                ));
            }
            if t.len() > 1 && (t.contains('*') || t.contains('>')) {
                return Err(format!(
                    "route pattern {pattern:?}: `*` and `>` must be whole tokens"
                ));
            }
        }
        Ok(TopicPattern {
            text: pattern.to_owned(),
            tokens,
        })
    }

    /// Does `topic` match?
    pub fn matches(&self, topic: &str) -> bool {
        let mut parts = topic.split('.');
        for (i, t) in self.tokens.iter().enumerate() {
            if t == ">" {
                // One or more tokens remain.
                return parts.next().is_some() && i + 1 == self.tokens.len();
            }
            match parts.next() {
                Some(p) if t == "*" || t == p => {}
                _ => return false,
            }
        }
        parts.next().is_none()
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// Settings of a [`Router`].
#[derive(Debug, Clone)]
pub struct RouterOptions {
    /// Bound on one destination's publish of its group, confirmations included (default
    /// 5 s). Keep it below the relay's publish timeout so a slow destination fails alone.
    pub destination_timeout: Duration,
    /// Consecutive unavailable batches that open a destination's breaker (default 3).
    pub failure_threshold: u32,
    /// First open period (default 1 s); doubles after each failed probe.
    pub open_base: Duration,
    /// Longest open period (default 10 s): the longest a recovered destination waits for
    /// its next probe.
    pub open_max: Duration,
}

impl Default for RouterOptions {
    fn default() -> Self {
        RouterOptions {
            destination_timeout: Duration::from_secs(5),
            failure_threshold: 3,
            open_base: Duration::from_secs(1),
            open_max: Duration::from_secs(10),
        }
    }
}

/// The state of one destination's circuit breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Publishing; `failures` consecutive unavailable batches so far.
    Closed {
        /// Consecutive unavailable batches.
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

struct Route {
    pattern: TopicPattern,
    sink: Arc<dyn Sink>,
    breaker: Mutex<BreakerState>,
}

/// A sink that routes by topic (see the module docs).
pub struct Router {
    routes: Vec<Route>,
    options: RouterOptions,
}

impl Router {
    /// A router over `routes`, tried in order (first match wins).
    pub fn new(routes: Vec<(TopicPattern, Arc<dyn Sink>)>, options: RouterOptions) -> Self {
        Router {
            routes: routes
                .into_iter()
                .map(|(pattern, sink)| Route {
                    pattern,
                    sink,
                    breaker: Mutex::new(BreakerState::Closed { failures: 0 }),
                })
                .collect(),
            options,
        }
    }

    /// Opens the sink of every `(pattern, url)` route with [`super::open`]; routes naming
    /// the same URL share one sink (one connection).
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
                url: url.clone(),
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
            .map(|r| {
                let state = *r.breaker.lock().unwrap_or_else(|e| e.into_inner());
                (r.pattern.as_str().to_owned(), state)
            })
            .collect()
    }

    fn route_of(&self, topic: &str) -> Option<usize> {
        self.routes.iter().position(|r| r.pattern.matches(topic))
    }

    /// `Some(rest)` while the breaker is open; `None` when a publish may go (closed, or
    /// the open period is over and this batch is the probe).
    fn open_for(&self, route: &Route) -> Option<Duration> {
        let state = *route.breaker.lock().unwrap_or_else(|e| e.into_inner());
        match state {
            BreakerState::Open { until, .. } => until.checked_duration_since(Instant::now()),
            BreakerState::Closed { .. } => None,
        }
    }

    fn record(&self, route: &Route, unavailable: bool) {
        let mut state = route.breaker.lock().unwrap_or_else(|e| e.into_inner());
        let o = &self.options;
        *state = match (*state, unavailable) {
            (_, false) => BreakerState::Closed { failures: 0 },
            (BreakerState::Closed { failures }, true) if failures + 1 < o.failure_threshold => {
                BreakerState::Closed {
                    failures: failures + 1,
                }
            }
            (BreakerState::Closed { .. }, true) => {
                tracing::warn!(route = route.pattern.as_str(), destination = %route.sink.describe(), open_for = ?o.open_base, "destination unavailable: circuit opened");
                BreakerState::Open {
                    until: Instant::now() + o.open_base,
                    period: o.open_base,
                }
            }
            (BreakerState::Open { period, .. }, true) => {
                let period = (period * 2).min(o.open_max);
                tracing::warn!(route = route.pattern.as_str(), destination = %route.sink.describe(), open_for = ?period, "destination still unavailable: circuit stays open");
                BreakerState::Open {
                    until: Instant::now() + period,
                    period,
                }
            }
        };
    }

    async fn publish_group(
        &self,
        route: &Route,
        msgs: Vec<OutgoingMessage>,
    ) -> Vec<Result<(), PublishError>> {
        if let Some(rest) = self.open_for(route) {
            let e = PublishError {
                kind: ErrorKind::Unavailable,
                message: format!(
                    "circuit open for {}: not publishing for another {rest:?}",
                    route.sink.describe()
                ),
                retry_after: Some(rest),
            };
            return vec![Err(e); msgs.len()];
        }
        let results =
            match tokio::time::timeout(self.options.destination_timeout, route.sink.publish(&msgs))
                .await
            {
                Ok(r) => r,
                Err(_) => vec![
                    Err(PublishError::unavailable(format!(
                        "{} did not answer within {:?}",
                        route.sink.describe(),
                        self.options.destination_timeout
                    )));
                    msgs.len()
                ],
            };
        let unavailable = !results.is_empty()
            && results
                .iter()
                .all(|r| matches!(r, Err(e) if e.kind == ErrorKind::Unavailable));
        self.record(route, unavailable);
        results
    }
}

#[async_trait]
impl Sink for Router {
    async fn publish(&self, batch: &[OutgoingMessage]) -> Vec<Result<(), PublishError>> {
        let mut out: Vec<Result<(), PublishError>> = vec![Ok(()); batch.len()];
        // Group by route, remembering each message's place in the batch.
        let mut groups: Vec<(Vec<usize>, Vec<OutgoingMessage>)> = (0..self.routes.len())
            .map(|_| (Vec::new(), Vec::new()))
            .collect();
        for (i, m) in batch.iter().enumerate() {
            match self.route_of(&m.topic) {
                Some(r) => {
                    groups[r].0.push(i);
                    groups[r].1.push(m.clone());
                }
                None => {
                    out[i] = Err(PublishError::permanent(format!(
                        "no route for topic {:?}: add a --route whose pattern matches it, or a catch-all --sink",
                        m.topic
                    )));
                }
            }
        }
        let published = join_all(
            groups
                .into_iter()
                .enumerate()
                .filter(|(_, (idx, _))| !idx.is_empty())
                .map(|(r, (idx, msgs))| async move {
                    (idx, self.publish_group(&self.routes[r], msgs).await)
                }),
        )
        .await;
        for (idx, results) in published {
            for (i, r) in idx.into_iter().zip(results) {
                out[i] = r;
            }
        }
        out
    }

    async fn close(&self) {
        join_all(self.routes.iter().map(|r| r.sink.close())).await;
    }

    fn describe(&self) -> String {
        let routes: Vec<String> = self
            .routes
            .iter()
            .map(|r| format!("{}={}", r.pattern.as_str(), r.sink.describe()))
            .collect();
        format!("router({})", routes.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::TopicPattern;

    fn m(p: &str, t: &str) -> bool {
        TopicPattern::parse(p)
            .unwrap_or_else(|e| panic!("{e}"))
            .matches(t)
    }

    #[test]
    fn wildcards_match_like_nats_subjects() {
        assert!(m("orders.*", "orders.placed"));
        assert!(!m("orders.*", "orders.placed.v1"));
        assert!(!m("orders.*", "orders"));
        assert!(m("orders.>", "orders.placed"));
        assert!(m("orders.>", "orders.placed.v1"));
        assert!(!m("orders.>", "orders"));
        assert!(m(">", "anything.at.all"));
        assert!(m("*.placed.*", "orders.placed.v1"));
        assert!(!m("*.placed.*", "orders.shipped.v1"));
        assert!(m("orders.placed.v1", "orders.placed.v1"));
        assert!(!m("orders.placed.v1", "orders.placed.v2"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in ["", "a..b", "a.>.b", "a.b*", "a.>x", "."] {
            assert!(TopicPattern::parse(bad).is_err(), "{bad:?}");
        }
    }
}
