//! Store conformance: job handlers ([`outbox::job`]). A relay over each store runs
//! handlers in-process; what each outcome leaves in the store's rows (dispatched, retried
//! with its attempt counted, dead with the error kept, given back on shutdown) is the
//! store's part of the contract, so every case runs on every store.

use super::*;
use outbox::job::{Handler, Job, JobError};
use outbox::sink::router::{Router, TopicPattern};
use outbox::store::{DeadSelector, ReplayAction, ReplayRequest};
use std::sync::atomic::AtomicUsize;

fn jobs_config(relay_id: &str) -> outbox::RelayConfig {
    outbox::RelayConfig {
        max_attempts: 3,
        ..relay_config(relay_id)
    }
}

async fn rows_of<B: Backend>(b: &B, topic: &str) -> Vec<Row> {
    b.select_rows(&format!("topic = '{topic}'")).await
}

/// Success, a transient failure then success, a permanent failure, a panic: each message
/// settles on its own. The permanent one is a dead letter at once with the handler's
/// error, listed, and a replay runs it again; the panicking one is retried with the panic's
/// message and quarantined at `max_attempts`; the relay runs on throughout.
pub(crate) async fn job_handlers_settle_each_outcome<B: Backend>() {
    let b = B::create("jobs", DEFAULT_MAX).await;
    let store = b.store();
    let ran: Arc<Mutex<Vec<(String, i32)>>> = Arc::default();
    let fixed = Arc::new(AtomicBool::new(false));
    let record = |ran: &Arc<Mutex<Vec<(String, i32)>>>, job: &Job| {
        ran.lock().unwrap().push((job.topic.clone(), job.attempt));
    };
    let (r1, r2, r3, r4) = (ran.clone(), ran.clone(), ran.clone(), ran.clone());
    let fixed_in = fixed.clone();
    let router = Router::builder()
        .handle(
            "jobs.ok",
            Handler::new("ok", move |job: Job| {
                record(&r1, &job);
                async move {
                    assert_eq!(&job.payload[..], b"payload-0");
                    Ok(())
                }
            }),
        )
        .handle(
            "jobs.flaky",
            Handler::new("flaky", move |job: Job| {
                record(&r2, &job);
                async move {
                    if job.attempt < 2 {
                        // Any std error converts into a retried failure.
                        let e: Result<(), std::io::Error> = Err(std::io::Error::other("smtp busy"));
                        e?;
                    }
                    Ok(())
                }
            }),
        )
        .handle(
            "jobs.permanent",
            Handler::new("permanent", move |job: Job| {
                record(&r3, &job);
                let fixed = fixed_in.load(Ordering::SeqCst);
                async move {
                    if fixed {
                        Ok(())
                    } else {
                        Err(JobError::permanent("no such mailbox"))
                    }
                }
            }),
        )
        .handle(
            "jobs.panic",
            Handler::new("panics", move |job: Job| {
                record(&r4, &job);
                async move {
                    if job.attempt > 0 {
                        panic!("boom at attempt {}", job.attempt);
                    }
                    Ok(())
                }
            }),
        )
        .build()
        .unwrap();
    let handle = Relay::with_router(store.clone(), router, jobs_config("jobs-outcomes")).spawn();
    for topic in ["jobs.ok", "jobs.flaky", "jobs.permanent", "jobs.panic"] {
        b.enqueue_all(&messages(topic, 1)).await;
    }
    crate::common::wait_settled("jobs settled", &store, 2, 2, Duration::from_secs(20)).await;

    let ok = &rows_of(&b, "jobs.ok").await[0];
    assert_eq!((ok.status, ok.attempts), (status::DISPATCHED, 1), "{ok:?}");
    let flaky = &rows_of(&b, "jobs.flaky").await[0];
    assert_eq!(
        (flaky.status, flaky.attempts),
        (status::DISPATCHED, 2),
        "{flaky:?}"
    );
    let perm = &rows_of(&b, "jobs.permanent").await[0];
    assert_eq!((perm.status, perm.attempts), (status::DEAD, 1), "{perm:?}");
    assert_eq!(
        perm.last_error.as_deref(),
        Some("permanent: no such mailbox")
    );
    let panicked = &rows_of(&b, "jobs.panic").await[0];
    assert_eq!(
        (panicked.status, panicked.attempts),
        (status::DEAD, 3),
        "{panicked:?}"
    );
    let err = panicked.last_error.clone().unwrap_or_default();
    assert!(
        err.contains("gave up after 3 attempts")
            && err.contains("the handler panicked: boom at attempt 3"),
        "{err}"
    );
    {
        let ran = ran.lock().unwrap();
        let runs = |t: &str| {
            ran.iter()
                .filter(|(topic, _)| topic == t)
                .map(|r| r.1)
                .collect::<Vec<_>>()
        };
        assert_eq!(runs("jobs.ok"), vec![1]);
        assert_eq!(runs("jobs.flaky"), vec![1, 2]);
        assert_eq!(runs("jobs.permanent"), vec![1]);
        assert_eq!(runs("jobs.panic"), vec![1, 2, 3]);
    }

    // The permanent failure is a dead letter with its error; once the cause is fixed, a
    // replay runs it again (attempts reset) and it is done.
    let selector = DeadSelector {
        topic: Some(TopicPattern::parse("jobs.permanent").unwrap()),
        ..DeadSelector::default()
    };
    let dead = store.dead_letters(&selector, 10, false).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("permanent: no such mailbox")
    );
    fixed.store(true, Ordering::SeqCst);
    store
        .replay(&ReplayRequest {
            selector,
            action: ReplayAction::Replay,
            limit: None,
            by: "ops".into(),
            reason: "mailbox created".into(),
            rate_per_s: None,
            dry_run: false,
            append_to: None,
        })
        .await
        .unwrap();
    crate::common::wait_settled(
        "the replayed job done",
        &store,
        3,
        1,
        Duration::from_secs(20),
    )
    .await;
    let perm = &rows_of(&b, "jobs.permanent").await[0];
    assert_eq!(
        (perm.status, perm.attempts),
        (status::DISPATCHED, 1),
        "{perm:?}"
    );
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, 3);
}

/// A handler that runs past its timeout is dropped, and counts like a publish timeout
/// after sending: its first refunds give the attempt back, then attempts count until the
/// job is a dead letter that says it ran past its timeout. A job beside it is not held up.
pub(crate) async fn a_job_past_its_timeout_counts_like_a_publish_timeout<B: Backend>() {
    let b = B::create("jobs_timeout", DEFAULT_MAX).await;
    let store = b.store();
    let calls = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    let (c, d) = (calls.clone(), dropped.clone());
    struct Dropped(Arc<AtomicUsize>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let router = Router::builder()
        .handle(
            "jobs.hang",
            Handler::new("hangs", move |_job: Job| {
                c.fetch_add(1, Ordering::SeqCst);
                let guard = Dropped(d.clone());
                async move {
                    let _guard = guard;
                    std::future::pending::<()>().await;
                    Ok(())
                }
            })
            .timeout(Duration::from_millis(100)),
        )
        .handle(
            "jobs.quick",
            Handler::new("quick", |_job: Job| async { Ok(()) }),
        )
        .build()
        .unwrap();
    let mut cfg = jobs_config("jobs-timeout");
    cfg.max_attempts = 2;
    let handle = Relay::with_router(store.clone(), router, cfg).spawn();
    b.enqueue_all(&messages("jobs.hang", 1)).await;
    b.enqueue_all(&messages("jobs.quick", 1)).await;
    crate::common::wait_settled(
        "the hanging job dead",
        &store,
        1,
        1,
        Duration::from_secs(30),
    )
    .await;
    let row = &rows_of(&b, "jobs.hang").await[0];
    assert_eq!(row.status, status::DEAD, "{row:?}");
    let err = row.last_error.clone().unwrap_or_default();
    assert!(err.contains("ran past its timeout of 100ms"), "{err}");
    assert!(
        err.contains("Handler::timeout") && !err.contains("--publish-timeout-ms"),
        "the hint names the handler's timeout, not the relay's: {err}"
    );
    let runs = calls.load(Ordering::SeqCst);
    let refunds = outbox::sink::router::TIMEOUT_REFUNDS as usize;
    assert_eq!(
        runs,
        refunds + 2,
        "{refunds} refunded timeouts, then 2 attempts"
    );
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        runs,
        "every overrun call was dropped"
    );
    handle.shutdown().await.unwrap();
}

/// A handler's concurrency limit holds across the relay's batches and workers: 24 jobs
/// that each take 100 ms never run more than 3 at once, and do reach 3.
pub(crate) async fn job_handlers_keep_their_concurrency_limit<B: Backend>() {
    let b = B::create("jobs_limit", DEFAULT_MAX).await;
    let store = b.store();
    let now = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (n, m) = (now.clone(), most.clone());
    let router = Router::builder()
        .handle(
            "jobs.>",
            Handler::new("limited", move |_job: Job| {
                let (n, m) = (n.clone(), m.clone());
                async move {
                    let running = n.fetch_add(1, Ordering::SeqCst) + 1;
                    m.fetch_max(running, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    n.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                }
            })
            .concurrency(3),
        )
        .build()
        .unwrap();
    let mut cfg = jobs_config("jobs-limit");
    cfg.batch_size = 4;
    let handle = Relay::with_router(store.clone(), router, cfg).spawn();
    b.enqueue_all(&messages("jobs.limited", 24)).await;
    crate::common::wait_settled("24 jobs done", &store, 24, 0, Duration::from_secs(30)).await;
    assert_eq!(
        most.load(Ordering::SeqCst),
        3,
        "at most 3 at once, and 3 reached"
    );
    handle.shutdown().await.unwrap();
}

/// A graceful shutdown waits for running jobs up to the grace: one that finishes within
/// it is done; one that does not is dropped and given back, pending with its attempt
/// refunded, to run again later.
pub(crate) async fn shutdown_waits_for_running_jobs_and_gives_back_the_rest<B: Backend>() {
    let b = B::create("jobs_shutdown", DEFAULT_MAX).await;
    let store = b.store();
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let router = Router::builder()
        .handle(
            "jobs.>",
            Handler::new("slow", move |job: Job| {
                s.fetch_add(1, Ordering::SeqCst);
                async move {
                    let ms = if job.topic == "jobs.short" {
                        300
                    } else {
                        60_000
                    };
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok(())
                }
            }),
        )
        .build()
        .unwrap();
    let mut cfg = jobs_config("jobs-shutdown");
    cfg.shutdown_grace = Duration::from_secs(1);
    let handle = Relay::with_router(store.clone(), router, cfg).spawn();
    b.enqueue_all(&[
        Message::new("jobs.short", b"s".to_vec()),
        Message::new("jobs.long", b"l".to_vec()),
    ])
    .await;
    wait_until("both jobs running", Duration::from_secs(10), || {
        let s = started.clone();
        async move {
            match s.load(Ordering::SeqCst) {
                2 => Ok(()),
                n => Err(format!("{n} started")),
            }
        }
    })
    .await;
    let began = Instant::now();
    let stats = handle.shutdown().await.unwrap();
    let took = began.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(10),
        "{took:?}"
    );
    assert_eq!((stats.dispatched, stats.released), (1, 1), "{stats:?}");
    let short = &rows_of(&b, "jobs.short").await[0];
    assert_eq!(short.status, status::DISPATCHED, "{short:?}");
    let long = &rows_of(&b, "jobs.long").await[0];
    assert_eq!(
        (long.status, long.attempts, long.claim_token),
        (status::PENDING, 0, None),
        "given back, attempt refunded: {long:?}"
    );
}

/// Jobs wait for a slot at most the handler's timeout: those a batch cannot start in time
/// are given back unstarted, their attempt refunded, and run later; none is charged for
/// waiting and none is cut short. The relay's publish timeout does not bound handlers: a
/// job longer than it, within the handler's own timeout, runs to the end once.
pub(crate) async fn jobs_behind_the_concurrency_limit_cost_no_attempts<B: Backend>() {
    let b = B::create("jobs_queued", DEFAULT_MAX).await;
    let store = b.store();
    let runs: Arc<Mutex<HashMap<Uuid, u32>>> = Arc::default();
    let (r1, r2) = (runs.clone(), runs.clone());
    let router = Router::builder()
        .handle(
            "jobs.queued",
            Handler::new("queued", move |job: Job| {
                *r1.lock().unwrap().entry(job.message_id).or_default() += 1;
                async move {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Ok(())
                }
            })
            .concurrency(1)
            .timeout(Duration::from_secs(1)),
        )
        .handle(
            "jobs.long",
            Handler::new("long", move |job: Job| {
                *r2.lock().unwrap().entry(job.message_id).or_default() += 1;
                async move {
                    tokio::time::sleep(Duration::from_millis(1_500)).await;
                    Ok(())
                }
            })
            .timeout(Duration::from_secs(10)),
        )
        .build()
        .unwrap();
    let mut cfg = jobs_config("jobs-queued");
    cfg.max_attempts = 1;
    cfg.publish_timeout = Duration::from_secs(1);
    let handle = Relay::with_router(store.clone(), router, cfg).spawn();
    // 15 jobs of 100 ms, one at a time: more than one timeout's worth in one claim.
    let queued = b.enqueue_all(&messages("jobs.queued", 15)).await;
    let long = b.enqueue_all(&messages("jobs.long", 1)).await;
    crate::common::wait_settled("16 jobs done", &store, 16, 0, Duration::from_secs(60)).await;
    let stats = handle.shutdown().await.unwrap();
    assert!(
        stats.retried >= 1,
        "some jobs were given back unstarted: {stats:?}"
    );
    let runs = runs.lock().unwrap().clone();
    for e in queued.iter().chain(&long) {
        assert_eq!(runs.get(&e.message_id), Some(&1), "each job ran once");
    }
    for r in rows_of(&b, "jobs.queued")
        .await
        .into_iter()
        .chain(rows_of(&b, "jobs.long").await)
    {
        assert_eq!((r.status, r.attempts), (status::DISPATCHED, 1), "{r:?}");
    }
}

/// A relay that dies while its handlers run (its task dropped: no settle, no release, as
/// a SIGKILL leaves it) leaves the jobs claimed; after the lease another relay runs each
/// again, same message id, as attempt 2, and marks it done.
pub(crate) async fn a_relay_killed_mid_job_leaves_it_to_run_again_after_the_lease<B: Backend>() {
    let b = B::create("jobs_killed", DEFAULT_MAX).await;
    let store = b.store();
    let first: Arc<Mutex<Vec<Uuid>>> = Arc::default();
    let f = first.clone();
    let router = Router::builder()
        .handle(
            "jobs.>",
            Handler::new("hangs", move |job: Job| {
                f.lock().unwrap().push(job.message_id);
                std::future::pending::<Result<(), JobError>>()
            }),
        )
        .build()
        .unwrap();
    let mut cfg = jobs_config("jobs-killed");
    cfg.lease = Duration::from_secs(1);
    let killed = tokio::spawn(
        Relay::with_router(store.clone(), router, cfg).run(outbox::CancellationToken::new()),
    );
    let jobs = b.enqueue_all(&messages("jobs.killed", 3)).await;
    wait_until("3 jobs running", Duration::from_secs(10), || {
        let f = first.clone();
        async move {
            match f.lock().unwrap().len() {
                3 => Ok(()),
                n => Err(format!("{n} running")),
            }
        }
    })
    .await;
    killed.abort();
    assert!(killed.await.unwrap_err().is_cancelled());
    for r in rows_of(&b, "jobs.killed").await {
        assert_eq!(r.attempts, 1, "{r:?}");
        assert!(
            r.claim_token.is_some() && r.status < status::DISPATCHED,
            "still claimed: {r:?}"
        );
    }

    let again: Arc<Mutex<Vec<(Uuid, i32)>>> = Arc::default();
    let a = again.clone();
    let router = Router::builder()
        .handle(
            "jobs.>",
            Handler::new("quick", move |job: Job| {
                a.lock().unwrap().push((job.message_id, job.attempt));
                async { Ok(()) }
            }),
        )
        .build()
        .unwrap();
    let handle = Relay::with_router(store.clone(), router, jobs_config("jobs-after")).spawn();
    crate::common::wait_settled("3 jobs done", &store, 3, 0, Duration::from_secs(20)).await;
    handle.shutdown().await.unwrap();
    let mut again = again.lock().unwrap().clone();
    again.sort();
    let mut expected: Vec<(Uuid, i32)> = jobs.iter().map(|e| (e.message_id, 2)).collect();
    expected.sort();
    assert_eq!(again, expected, "each job once more, same id, attempt 2");
}
