//! Jobs: the outbox as a transactional job queue. A [`Handler`] is a destination whose
//! "broker" is an async function in the relay's own process: route a topic pattern to it
//! ([`Router::builder`](crate::sink::router::Router::builder)`.handle(…)`) and the relay
//! runs each claimed message of that topic through it, after the producer's transaction
//! committed, at least once.
//!
//! ```no_run
//! use outbox::job::{Handler, Job, JobError};
//! use outbox::sink::router::Router;
//! use std::time::Duration;
//!
//! async fn send_welcome(job: Job) -> Result<(), JobError> {
//!     let user: serde_json::Value = job.json()?; // a payload that is not JSON: dead letter
//!     // … send the e-mail; an error returned with `?` is retried with backoff
//!     let _ = user;
//!     Ok(())
//! }
//!
//! # fn main() -> Result<(), outbox::sink::SinkError> {
//! let router = Router::builder()
//!     .handle(
//!         "emails.welcome",
//!         Handler::new("send_welcome", send_welcome)
//!             .concurrency(8)
//!             .timeout(Duration::from_secs(10)),
//!     )
//!     .build()?;
//! # let _ = router; Ok(()) }
//! ```
//!
//! What a handler's outcome means (one per message; the relay settles each on its own):
//! - `Ok(())`: done; the row is marked dispatched (or deleted with `delete_dispatched`).
//! - [`JobError::retry`] (and any error converted with `?`): transient; the message is
//!   retried with the relay's persisted backoff and jitter, and quarantined as a dead
//!   letter once it has used `max_attempts`, with the error kept (`outbox dead list`,
//!   `outbox replay` runs it again).
//! - [`JobError::permanent`]: quarantined as a dead letter at once, with the error.
//! - A **panic**: transient, with the panic's message; the relay does not crash (the call
//!   runs under `catch_unwind`).
//! - Running past the handler's [`Handler::timeout`] (default [`DEFAULT_TIMEOUT`]): the
//!   call is dropped (cancelled at its next `.await`) and counts like a publish timeout
//!   after sending: the relay's router gives the attempt back for the first
//!   [`TIMEOUT_REFUNDS`](crate::sink::router::TIMEOUT_REFUNDS) such timeouts of a message,
//!   then counts them, so a job that always hangs ends as a dead letter.
//! - **Not started**: a job that waited for a free slot (the [`Handler::concurrency`]
//!   limit) for as long as the handler's timeout is given back without running, its
//!   attempt refunded (code `not_started`), and claimed again after 500 ms, by this relay or
//!   another: a claim larger than the handler can run in time costs no attempts.
//!
//! The handler's own timeout bounds its jobs, not the relay's publish timeout
//! (`RelayConfig::publish_timeout`, which bounds the brokers' publishes): a batch of jobs
//! ends within twice the handler's timeout (a job waits at most one timeout for its slot,
//! then runs at most one).
//!
//! Error texts (a returned error, a panic's message) are kept as the row's `last_error`
//! and logged, cut to [`MAX_ERROR_BYTES`].
//!
//! The relay's guarantees hold as for a broker: the claim's lease is renewed while
//! handlers run; per-key ordering (`RelayConfig::ordering`) runs a key's jobs one after
//! the other; on graceful shutdown the relay waits for running handlers up to its
//! shutdown grace, then drops them (cancelled at their next `.await`) and gives their
//! messages back, attempt refunded; a process killed mid-handler leaves its claim to
//! expire, and the job runs again, same message id, on any relay. A handler may therefore
//! run more than once for one message: a handler whose effect must happen once records
//! the message id in the inbox ([`crate::inbox`]) in the same transaction as its work.
//!
//! Handlers run as futures on the relay's worker tasks (a batch's jobs concurrently, up to
//! [`Handler::concurrency`]), not each on a task of its own. A job that computes for long
//! without an `.await`, or calls blocking code (`std::thread::sleep`, a synchronous
//! client), holds that worker: meanwhile its timeout cannot fire and the claim's lease is
//! not renewed, so past the lease another relay (or another worker of the same relay)
//! claims and runs the job again. Do that part in `tokio::task::spawn_blocking`.
//!
//! Metrics and spans name the destination `handler:NAME`.

use crate::message::OutgoingMessage;
use crate::sink::{Confirmations, PublishCode, PublishError, Sink};
use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures::FutureExt as _;
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use uuid::Uuid;

/// Default [`Handler::concurrency`]: calls of one handler running at once.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// Default [`Handler::timeout`]: 30 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest error text kept from a job (a returned error or a panic's message): 2,048
/// bytes; a longer one is cut at a character boundary and says how long it was.
pub const MAX_ERROR_BYTES: usize = 2_048;

/// `text` cut to [`MAX_ERROR_BYTES`].
fn bounded(text: String) -> String {
    if text.len() <= MAX_ERROR_BYTES {
        return text;
    }
    let end = text.floor_char_boundary(MAX_ERROR_BYTES);
    format!("{}… (cut; {} bytes in all)", &text[..end], text.len())
}

/// One job: the message a handler runs, as the relay claimed it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Job {
    /// The row's primary key.
    pub id: i64,
    /// The message id: stable across retries and replays (the inbox's key).
    pub message_id: Uuid,
    /// The topic.
    pub topic: String,
    /// The ordering key.
    pub key: Option<String>,
    /// The stored headers (correlation id, trace context, content type, …).
    pub headers: BTreeMap<String, String>,
    /// The payload bytes.
    pub payload: Bytes,
    /// When the producer enqueued it (database clock).
    pub occurred_at: DateTime<Utc>,
    /// This run's attempt number, from 1 (attempts given back by outages do not count).
    pub attempt: i32,
}

impl Job {
    /// A job of `topic` and `payload` as a relay would hand it over for its first attempt:
    /// a new message id, no key, no headers, enqueued now. For testing handlers.
    /// `payload` is anything that reads as bytes (`b"…"`, `&str`, `String`, `Vec<u8>`).
    pub fn new(topic: impl Into<String>, payload: impl AsRef<[u8]>) -> Self {
        Job {
            id: 0,
            message_id: Uuid::now_v7(),
            topic: topic.into(),
            key: None,
            headers: BTreeMap::new(),
            payload: Bytes::copy_from_slice(payload.as_ref()),
            occurred_at: Utc::now(),
            attempt: 1,
        }
    }

    fn of(m: &OutgoingMessage) -> Self {
        Job {
            id: m.id,
            message_id: m.message_id,
            topic: m.topic.clone(),
            key: m.key.clone(),
            headers: m.headers.clone(),
            payload: m.payload.clone(),
            occurred_at: m.occurred_at,
            attempt: m.attempts,
        }
    }

    /// The payload parsed as JSON into `T`.
    ///
    /// # Errors
    /// A [`JobError::permanent`] naming the parse error when the payload is not `T` in
    /// JSON: running it again would not change that.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, JobError> {
        serde_json::from_slice(&self.payload)
            .map_err(|e| JobError::permanent(format!("the payload is not the JSON expected: {e}")))
    }
}

/// Why a job failed: retried ([`JobError::retry`]) or not ([`JobError::permanent`]).
///
/// Any `std::error::Error` converts into a retried one, so `?` works in a handler on the
/// errors of the libraries it calls. It does not implement `std::error::Error` itself
/// (that conversion would then conflict with the identity one), but converts into
/// `Box<dyn Error>` (and `+ Send + Sync`), so `?` works on it in a test or `main` too.
#[derive(Debug)]
pub struct JobError {
    permanent: bool,
    message: String,
    retry_after: Option<Duration>,
}

impl JobError {
    /// A failure worth retrying: the relay's persisted backoff decides when (at least
    /// [`JobError::after`] when given).
    pub fn retry(message: impl fmt::Display) -> Self {
        JobError {
            permanent: false,
            message: message.to_string(),
            retry_after: None,
        }
    }

    /// A failure no retry will fix: the message becomes a dead letter at once, with
    /// `message` as its error.
    pub fn permanent(message: impl fmt::Display) -> Self {
        JobError {
            permanent: true,
            message: message.to_string(),
            retry_after: None,
        }
    }

    /// Retry no sooner than `delay` from now (a retried failure only); the relay bounds
    /// every retry delay to 24 hours, this one too.
    #[must_use]
    pub fn after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// True for [`JobError::permanent`].
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    /// The error's text (kept as the row's `last_error`).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl<E: std::error::Error> From<E> for JobError {
    fn from(e: E) -> Self {
        JobError::retry(e)
    }
}

/// A [`JobError`] as a `std::error::Error`: what `?` turns it into in a function that
/// returns `Box<dyn Error>` (a test of a handler, `main`).
#[derive(Debug)]
struct FailedJob(String);

impl fmt::Display for FailedJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FailedJob {}

impl From<JobError> for Box<dyn std::error::Error + Send + Sync> {
    fn from(e: JobError) -> Self {
        Box::new(FailedJob(e.to_string()))
    }
}

impl From<JobError> for Box<dyn std::error::Error> {
    fn from(e: JobError) -> Self {
        Box::new(FailedJob(e.to_string()))
    }
}

impl fmt::Display for JobError {
    /// `permanent: …` or `retry: …` and the message.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.permanent { "permanent" } else { "retry" };
        write!(f, "{kind}: {}", self.message)
    }
}

type HandlerFn = dyn Fn(Job) -> BoxFuture<'static, Result<(), JobError>> + Send + Sync;

/// An async function run for each message routed to it: a destination in the relay's own
/// process (see the [module docs](self)). Cheap to clone; clones share the concurrency
/// limit.
#[derive(Clone)]
pub struct Handler {
    name: String,
    run: Arc<HandlerFn>,
    permits: Arc<Semaphore>,
    concurrency: usize,
    timeout: Duration,
}

impl Handler {
    /// A handler named `name` (in logs, metrics and spans as `handler:NAME`) that runs
    /// `f` for each message, at most [`DEFAULT_CONCURRENCY`] at once, each for at most
    /// [`DEFAULT_TIMEOUT`].
    pub fn new<F, Fut>(name: impl Into<String>, f: F) -> Self
    where
        F: Fn(Job) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), JobError>> + Send + 'static,
    {
        Handler {
            name: name.into(),
            run: Arc::new(move |job| Box::pin(f(job))),
            permits: Arc::new(Semaphore::new(DEFAULT_CONCURRENCY)),
            concurrency: DEFAULT_CONCURRENCY,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// At most `n` calls running at once (at least 1), across every batch and relay
    /// worker of this process. Clones made after this call share the limit; calling it
    /// on a clone gives that clone a limit of its own.
    #[must_use]
    pub fn concurrency(mut self, n: usize) -> Self {
        let n = n.clamp(1, Semaphore::MAX_PERMITS);
        self.permits = Arc::new(Semaphore::new(n));
        self.concurrency = n;
        self
    }

    /// A call running longer than `timeout` (default [`DEFAULT_TIMEOUT`], at least 1 ms)
    /// is dropped and counts like a publish timeout; a job that waited that long for a
    /// free slot is given back unstarted (see the [module docs](self)). The relay's
    /// publish timeout does not apply to handlers.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The handler's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its concurrency limit.
    pub fn concurrency_limit(&self) -> usize {
        self.concurrency
    }

    /// Runs one job under the timeout; `Err` is the outcome the relay settles.
    async fn call(run: Arc<HandlerFn>, job: Job, timeout: Duration) -> Result<(), PublishError> {
        let Ok(outcome) = tokio::time::timeout(timeout, run(job)).await else {
            return Err(PublishError::timed_out_after_send(format!(
                "the handler ran past its timeout of {timeout:?}"
            )));
        };
        outcome.map_err(|e| {
            let message = bounded(e.message);
            let err = if e.permanent {
                PublishError::permanent(message)
            } else {
                PublishError::transient(message)
            };
            let err = err.with_code(PublishCode::HandlerFailed);
            match e.retry_after {
                Some(after) if !e.permanent => err.with_retry_after(after),
                _ => err,
            }
        })
    }
}

impl fmt::Debug for Handler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handler")
            .field("name", &self.name)
            .field("concurrency", &self.concurrency)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The text of a panic's payload (`panic!("…")` gives a `&str` or a `String`), bounded;
/// the payload is dropped under `catch_unwind` (a payload whose `Drop` panics must not
/// take the relay down with it; what such a drop panics with is leaked, not dropped).
fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned());
    if let Err(again) = std::panic::catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
    bounded(text)
}

#[async_trait]
impl Sink for Handler {
    /// Runs the messages of `batch` concurrently, at most the concurrency limit at once,
    /// each call's panic caught, and records each outcome as it comes (outcomes ready
    /// together, under one lock). A job that waited the handler's timeout for a slot is
    /// given back unstarted. Dropping the returned future (the shutdown grace passed)
    /// drops the calls still running and those not started: their slots stay empty, so
    /// the relay gives them back.
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let mut running: FuturesUnordered<_> = batch
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let job = Job::of(m);
                async move {
                    let permit = tokio::time::timeout(self.timeout, self.permits.acquire()).await;
                    // The semaphore is never closed: acquire fails only if it were.
                    let Ok(Ok(_permit)) = permit else {
                        return (
                            i,
                            Err(PublishError::unavailable(format!(
                                "not started: {} had all {} slots busy for its timeout of {:?} (given back, attempt refunded)",
                                self.describe(),
                                self.concurrency,
                                self.timeout
                            ))
                            .with_code(PublishCode::NotStarted)),
                        );
                    };
                    // Started: a timeout from now on is the job's, not an outage.
                    confirm.mark_sent(i);
                    let outcome =
                        AssertUnwindSafe(Handler::call(self.run.clone(), job, self.timeout))
                            .catch_unwind()
                            .await
                            .unwrap_or_else(|panic| {
                                Err(PublishError::transient(format!(
                                    "the handler panicked: {}",
                                    panic_text(panic)
                                ))
                                .with_code(PublishCode::HandlerPanicked))
                            });
                    (i, outcome)
                }
            })
            .collect();
        // Outcomes that are ready together are recorded together: one wake-up of the
        // relay per group, not one per job (a thousand quick jobs finish in one poll).
        while let Some(first) = running.next().await {
            let mut done = vec![first];
            while let Some(Some(next)) = running.next().now_or_never() {
                done.push(next);
            }
            confirm.set_many(done);
        }
    }

    /// Twice the handler's timeout, and a second: a job waits at most one timeout for a
    /// slot and runs at most one, so the router's own bound never cuts a job short.
    fn publish_timeout(&self, _relay: Duration) -> Duration {
        self.timeout
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(1))
    }

    fn slow_hint(&self) -> String {
        format!(
            "if its jobs need longer, raise the handler's timeout (Handler::timeout, now {:?})",
            self.timeout
        )
    }

    fn describe(&self) -> String {
        format!("handler:{}", self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_texts_are_cut_at_a_character_boundary() {
        let short = "x".repeat(MAX_ERROR_BYTES);
        assert_eq!(bounded(short.clone()), short);
        let long = "é".repeat(MAX_ERROR_BYTES); // 2 bytes each
        let cut = bounded(long);
        assert!(
            cut.ends_with(&format!("… (cut; {} bytes in all)", 2 * MAX_ERROR_BYTES)),
            "{cut}"
        );
        assert!(cut.len() < MAX_ERROR_BYTES + 40, "{}", cut.len());
    }

    #[test]
    fn a_panic_payload_whose_drop_panics_is_contained() {
        struct Bomb;
        impl Drop for Bomb {
            fn drop(&mut self) {
                panic!("the payload panicked on drop");
            }
        }
        let payload = std::panic::catch_unwind(|| std::panic::panic_any(Bomb)).unwrap_err();
        assert_eq!(panic_text(payload), "a panic without a message");
        let payload = std::panic::catch_unwind(|| panic!("plain {}", 1)).unwrap_err();
        assert_eq!(panic_text(payload), "plain 1");
    }
}
