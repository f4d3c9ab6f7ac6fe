//! Jobs: run code after your transaction commits, at least once, retried, visible when it
//! dies. A sign-up writes its user row and a `emails.welcome` job in one SQLite
//! transaction; the relay runs the job through a handler in this process, which sends the
//! e-mail once per job however often it runs (the inbox, in the handler's transaction).
//! Copy it.
//!
//! ```text
//! cargo run -p outbox --example jobs                 # sign up 3 users, run their jobs, exit
//! cargo run -p outbox --example jobs -- signup 100   # only write 100 sign-ups
//! cargo run -p outbox --example jobs -- work         # run jobs until Ctrl-C
//! cargo run -p outbox --example jobs -- work --drain # run the jobs due, then exit (jobs
//!                                                    # waiting for a retry stay pending)
//! ```
//!
//! What each outcome of the handler does: `Ok` marks the job done; an error returned with
//! `?` (the database was busy) retries it with backoff; [`JobError::permanent`] (a payload
//! that is not a sign-up) makes it a dead letter at once, listed by `outbox dead list` and
//! run again by `outbox replay`; a panic is retried like an error. A process killed while
//! a handler runs leaves the job claimed until its lease ends; then any worker runs it
//! again, with the same message id, and the inbox makes that second run send nothing twice.
//!
//! Settings (environment): `OUTBOX_DATABASE_URL` (default `sqlite://jobs.db`),
//! `JOBS_LEASE_MS` (the claim's lease, default 30000), `JOBS_HANDLER_DELAY_MS` (how long the
//! handler takes before it sends, default 0: to watch a crash mid-job).

use outbox::job::{Handler, Job, JobError};
use outbox::sink::router::Router;
use outbox::sqlite::SqliteStore;
use outbox::store::prelude::*;
use outbox::{Accepted, Message, Relay, RelayConfig, StoreConfig};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// The job's payload.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Welcome {
    /// The new user.
    pub user_id: i64,
    /// Where to send the e-mail.
    pub email: String,
}

/// Opens (and migrates) the store and the example's tables.
pub async fn open(url: &str) -> Result<SqliteStore, Box<dyn std::error::Error + Send + Sync>> {
    let store = SqliteStore::connect(url, StoreConfig::default()).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS users (id INTEGER PRIMARY KEY, email TEXT NOT NULL);
         CREATE TABLE IF NOT EXISTS welcome_emails (
           message_id TEXT PRIMARY KEY, user_id INTEGER NOT NULL, email TEXT NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    Ok(store)
}

/// A sign-up: the user row and its welcome job, in one transaction.
pub async fn sign_up(store: &SqliteStore, email: &str) -> Result<i64, outbox::Error> {
    let mut tx = store.pool().begin().await?;
    let (user_id,): (i64,) = sqlx::query_as("INSERT INTO users (email) VALUES (?) RETURNING id")
        .bind(email)
        .fetch_one(&mut *tx)
        .await?;
    let job = Message::json(
        "emails.welcome",
        &Welcome {
            user_id,
            email: email.to_owned(),
        },
    )?;
    store.enqueue(&mut tx, &job).await?;
    tx.commit().await?;
    Ok(user_id)
}

/// The handler: "sends" the e-mail (a row in `welcome_emails`) once per job, whatever the
/// number of runs: the inbox accepts the job's message id in the same transaction.
pub async fn send_welcome(store: SqliteStore, job: Job, delay: Duration) -> Result<(), JobError> {
    let welcome: Welcome = job.json()?; // not a sign-up: a dead letter, no retry
    println!(
        "job {} attempt {}: user {}",
        job.message_id, job.attempt, welcome.user_id
    );
    tokio::time::sleep(delay).await;
    let mut tx = store.pool().begin().await?;
    if store.inbox_accept(&mut tx, "welcome-email", &job).await? == Accepted::Fresh {
        sqlx::query("INSERT INTO welcome_emails (message_id, user_id, email) VALUES (?, ?, ?)")
            .bind(job.message_id.to_string())
            .bind(welcome.user_id)
            .bind(&welcome.email)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Runs the jobs until `stop` completes (or, with `drain`, until none is due: jobs waiting
/// for a retry stay pending); returns how many ran to success.
pub async fn work(
    store: SqliteStore,
    drain: bool,
    lease: Duration,
    delay: Duration,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    let handler_store = store.clone();
    let router = Router::builder()
        .handle(
            "emails.welcome",
            Handler::new("send_welcome", move |job| {
                send_welcome(handler_store.clone(), job, delay)
            })
            .concurrency(4)
            .timeout(Duration::from_secs(20)),
        )
        .build()?;
    let config = RelayConfig {
        relay_id: "jobs-example".into(),
        drain,
        lease,
        ..RelayConfig::default()
    };
    let relay = Relay::with_router(Arc::new(store), router, config).spawn();
    let token = relay.cancellation_token();
    let stopper = tokio::spawn(async move {
        stop.await;
        token.cancel(); // a graceful shutdown: running jobs get the grace, the rest go back
    });
    let stats = relay.wait().await?;
    stopper.abort();
    Ok(stats.dispatched)
}

fn env_ms(name: &str, default: u64) -> Duration {
    Duration::from_millis(
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let url = std::env::var("OUTBOX_DATABASE_URL").unwrap_or_else(|_| "sqlite://jobs.db".into());
    let store = open(&url).await?;
    let (lease, delay) = (
        env_ms("JOBS_LEASE_MS", 30_000),
        env_ms("JOBS_HANDLER_DELAY_MS", 0),
    );
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match args.as_slice() {
        ["signup", n] => {
            let n: u32 = n
                .parse()
                .map_err(|_| format!("signup N: {n:?} is not a count"))?;
            for i in 0..n {
                sign_up(&store, &format!("user{i}@example.com")).await?;
            }
            println!("{n} sign-ups written, each with its welcome job");
        }
        ["work"] => println!(
            "{} jobs ran",
            work(store, false, lease, delay, ctrl_c).await?
        ),
        ["work", "--drain"] => println!(
            "{} jobs ran",
            work(store, true, lease, delay, ctrl_c).await?
        ),
        [] => {
            for email in ["ada@example.com", "grace@example.com", "edsger@example.com"] {
                sign_up(&store, email).await?;
            }
            println!(
                "{} jobs ran",
                work(store, true, lease, delay, ctrl_c).await?
            );
        }
        _ => return Err("usage: jobs [signup N | work [--drain]]".into()),
    }
    Ok(())
}
