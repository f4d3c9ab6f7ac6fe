//! Jobs end to end with the example service (`examples/jobs.rs`, compiled in as a module,
//! so this runs the code users copy): sign-ups enqueue welcome jobs in their transaction;
//! a worker process is SIGKILLed while its handlers run; another worker runs every job
//! after the lease, with the same message ids, and each e-mail is sent once.

#[path = "../../../examples/jobs.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
mod example;

use crate::common::wait_until;
use std::io::BufRead as _;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The database URL a worker process runs against (set only for the child).
const CHILD: &str = "OUTBOX_TEST_JOBS_WORKER_URL";
/// The lease of the killed worker's claims.
const LEASE: Duration = Duration::from_millis(1_000);

/// Not a test of its own: the worker process `a_worker_killed_mid_job_loses_no_job`
/// starts (this test binary again, with [`CHILD`] set) and SIGKILLs while its handlers
/// run. Without the variable it returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_worker_process() {
    let Ok(url) = std::env::var(CHILD) else {
        return;
    };
    let store = example::open(&url).await.unwrap();
    // Handlers that take an hour: the process is killed while they run.
    example::work(
        store,
        false,
        LEASE,
        Duration::from_secs(3600),
        std::future::pending(),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_mid_job_loses_no_job() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("jobs.db").display());
    let store = example::open(&url).await.unwrap();
    for i in 0..6 {
        example::sign_up(&store, &format!("user{i}@example.com"))
            .await
            .unwrap();
    }

    let mut worker = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "relay::jobs_e2e::jobs_worker_process",
            "--nocapture",
        ])
        .env(CHILD, &url)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The example's handler prints a line as it starts a job; wait for its 4 (its
    // concurrency) first runs, then kill the process mid-job.
    let stdout = worker.stdout.take().unwrap();
    let started = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .filter(|l| l.starts_with("job ") && l.contains("attempt 1:"))
            .take(4)
            .count()
    });
    let n = tokio::time::timeout(Duration::from_secs(60), started)
        .await
        .expect("the worker started its jobs within 60 s")
        .unwrap();
    assert_eq!(n, 4, "the worker started 4 jobs");
    worker.kill().unwrap(); // SIGKILL
    worker.wait().unwrap();

    let pool = store.pool().clone();
    let sent = |pool: sqlx::SqlitePool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM welcome_emails")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(
        sent(pool.clone()).await,
        0,
        "no job finished before the kill"
    );
    let claimed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_messages WHERE claim_token IS NOT NULL AND status = 0",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        claimed >= 4,
        "the killed worker's claims are left to expire: {claimed}"
    );

    // Another worker: after the lease, every job runs, each e-mail once.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(example::work(
        store.clone(),
        false,
        Duration::from_secs(30),
        Duration::ZERO,
        async {
            let _ = stopped.await;
        },
    ));
    wait_until("6 welcome e-mails", Duration::from_secs(30), || {
        let pool = pool.clone();
        async move {
            match sent(pool).await {
                6 => Ok(()),
                n => Err(format!("{n} sent")),
            }
        }
    })
    .await;
    stop.send(()).unwrap();
    assert_eq!(worker.await.unwrap().unwrap(), 6);
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT m.message_id, m.status, m.attempts FROM outbox_messages m
         JOIN welcome_emails w ON w.message_id = m.message_id ORDER BY m.id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows.len(),
        6,
        "each job's e-mail, by its message id: {rows:?}"
    );
    assert!(rows.iter().all(|r| r.1 == 2), "every job done: {rows:?}");
    let again = rows.iter().filter(|r| r.2 == 2).count();
    assert!(
        again >= 4,
        "the jobs the killed worker held ran again as attempt 2: {rows:?}"
    );
}
