//! The table path's cost against a bare reference relay: PostgreSQL → NATS JetStream on
//! this machine. Prints figures; asserts nothing about speed. Run:
//! `cargo bench -p outbox --bench table_path` (PostgreSQL and NATS must be running; see
//! the README). It first runs `cargo build --release -p outbox-cli` and uses that
//! `outbox` binary.
//!
//! Each run drains `BENCH_ROWS` (100,000) rows of 300 bytes, each with a key of its own,
//! inserted by one `INSERT … SELECT FROM generate_series` into a fresh schema, to a fresh
//! JetStream stream, in a child process of its own:
//! - ours: `outbox relay --drain` at its defaults but `--batch-size BENCH_BATCH` (1,000),
//!   `--ordered` for another topic pattern than the rows' (so the ordered claim runs),
//!   `--on-dispatch keep` or `delete`;
//! - the reference: this bench re-executed (`BENCH_TABLE_PATH_REFERENCE=update|delete`), a
//!   bare relay with no features over a plain table of the same columns and one index:
//!   as many claim loops as our relay has batches in flight by default, each claiming by
//!   one `UPDATE … RETURNING` (`SKIP LOCKED`, a token per claim), publishing the batch
//!   with pipelined PubAcks and `Nats-Msg-Id`, then marking by `UPDATE` or `DELETE`,
//!   until its first empty claim.
//!
//! Per run: msg/s over the child's wall time, the child's CPU (user + system, from
//! `wait4`) and PostgreSQL's CPU per 100,000 messages, WAL bytes per message, and the
//! child's peak RSS. `BENCH_PAIRS` (3) pairs, each running the reference and ours for keep
//! (`UPDATE`) and for delete, alternating which goes first; then the medians of the ratios
//! ours / reference. Every run starts after a `CHECKPOINT`. The bench exits non-zero when
//! a run leaves live rows behind (the measurement would be wrong).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
#![allow(clippy::cast_possible_truncation)]

use async_nats::jetstream::message::PublishMessage;
use outbox::RelayConfig;
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use uuid::Uuid;

const PG: &str = "postgres://postgres@127.0.0.1:5432/test";
const NATS: &str = "nats://127.0.0.1:4222";

/// Set in the re-executed child: `update` or `delete` (how the reference marks).
const REFERENCE: &str = "BENCH_TABLE_PATH_REFERENCE";
/// The reference child's schema.
const REFERENCE_SCHEMA: &str = "BENCH_TABLE_PATH_SCHEMA";
/// The reference child's rows per claim.
const REFERENCE_BATCH: &str = "BENCH_TABLE_PATH_BATCH";

/// Schemas and streams made and not yet dropped: what the clean-up after a failure drops.
static CREATED: Mutex<(Vec<String>, Vec<String>)> = Mutex::new((Vec::new(), Vec::new()));

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace(['_', ','], "").parse().ok())
        .unwrap_or(default)
}

fn short_id() -> String {
    Uuid::new_v4().simple().to_string()[..8].to_owned()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Who {
    Ours,
    Reference,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dispatch {
    /// Ours `--on-dispatch keep`, the reference's `UPDATE` mark.
    Keep,
    /// Ours `--on-dispatch delete`, the reference's `DELETE` mark.
    Delete,
}

impl Dispatch {
    fn label(self, who: Who) -> &'static str {
        match (who, self) {
            (Who::Ours, Dispatch::Keep) => "ours keep",
            (Who::Ours, Dispatch::Delete) => "ours delete",
            (Who::Reference, Dispatch::Keep) => "reference UPDATE",
            (Who::Reference, Dispatch::Delete) => "reference DELETE",
        }
    }
}

/// One run's figures.
#[derive(Clone, Copy, Default)]
struct Figures {
    rate: f64,
    /// The child's user + system seconds per 100,000 messages.
    relay_cpu: f64,
    /// PostgreSQL's user + system seconds per 100,000 messages.
    pg_cpu: f64,
    wal_per_msg: f64,
    rss_mb: f64,
}

impl Figures {
    fn ratio(&self, reference: &Figures) -> Figures {
        Figures {
            rate: self.rate / reference.rate,
            relay_cpu: self.relay_cpu / reference.relay_cpu,
            pg_cpu: self.pg_cpu / reference.pg_cpu,
            wal_per_msg: self.wal_per_msg / reference.wal_per_msg,
            rss_mb: self.rss_mb / reference.rss_mb,
        }
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// The CPU time, in clock ticks, of every PostgreSQL process: utime + stime of each live
/// one, plus cutime + cstime (the backends that exited and were reaped by the postmaster,
/// such as the child's connections once it ends). It includes the background writer,
/// checkpointer, WAL writer and autovacuum (when on), not only the backends serving the
/// child: a difference over a run is PostgreSQL's whole cost of that run on this machine.
fn postgres_ticks() -> u64 {
    let mut ticks = 0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let dir = entry.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let is_postgres = comm.trim() == "postgres"
            || std::fs::read(dir.join("cmdline")).is_ok_and(|c| c.starts_with(b"postgres"));
        if !is_postgres {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(dir.join("stat")) else {
            continue;
        };
        // After the command's closing parenthesis: field 3 (state) onwards; utime, stime,
        // cutime and cstime are fields 14 to 17.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        ticks += fields[11..15]
            .iter()
            .map(|f| f.parse::<u64>().unwrap_or(0))
            .sum::<u64>();
    }
    ticks
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a system constant.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// What `wait4` said of a child that ended.
struct Ended {
    wall: Duration,
    status: i32,
    cpu_secs: f64,
    max_rss_kb: i64,
}

/// Waits for `pid` (polling every millisecond, so that a hung child can be killed after
/// `timeout`), and returns its wall time since `started`, exit status, CPU and peak RSS.
fn wait_child(pid: i32, started: Instant, timeout: Duration) -> Ended {
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid value; wait4 fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut killed = false;
    loop {
        // SAFETY: pid is our own child, not yet reaped; the pointers are valid.
        let r = unsafe { libc::wait4(pid, &raw mut status, libc::WNOHANG, &raw mut usage) };
        if r == pid {
            break;
        }
        assert!(r == 0, "wait4: {}", std::io::Error::last_os_error());
        if !killed && started.elapsed() > timeout {
            eprintln!("the child {pid} ran longer than {timeout:?}: killing it");
            // SAFETY: pid is our child, not reaped yet (wait4 just said it runs).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let wall = started.elapsed();
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ended {
        wall,
        status,
        cpu_secs: secs(usage.ru_utime) + secs(usage.ru_stime),
        // Linux: kilobytes.
        max_rss_kb: usage.ru_maxrss,
    }
}

fn exit_code(status: i32) -> Option<i32> {
    libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status))
}

/// The `outbox` binary: `cargo build --release -p outbox-cli` (unless `BENCH_OUTBOX_BIN`
/// names one), under `CARGO_TARGET_DIR` or the target directory this bench runs from.
fn outbox_binary() -> PathBuf {
    if let Ok(bin) = std::env::var("BENCH_OUTBOX_BIN") {
        return PathBuf::from(bin);
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("building the CLI first: {cargo} build --release -p outbox-cli");
    let ok = Command::new(&cargo)
        .args(["build", "--release", "-p", "outbox-cli"])
        .status()
        .expect("cargo runs")
        .success();
    assert!(ok, "cargo build --release -p outbox-cli failed");
    let release = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir).join("release"),
        // <target>/release/deps/table_path-HASH
        None => std::env::current_exe()
            .unwrap()
            .parent()
            .and_then(Path::parent)
            .unwrap()
            .to_path_buf(),
    };
    let bin = release.join("outbox");
    assert!(bin.exists(), "no {}", bin.display());
    bin
}

/// A child command with no `OUTBOX_*` variables of ours, run in `dir` (no ./outbox.toml).
fn child(program: &Path, dir: &Path) -> Command {
    let mut cmd = Command::new(program);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("OUTBOX_") {
            cmd.env_remove(k);
        }
    }
    cmd.current_dir(dir);
    cmd
}

async fn exec(pool: &PgPool, sql: String) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await
        .unwrap();
}

async fn scalar(pool: &PgPool, sql: String) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn wal_bytes(pool: &PgPool) -> i64 {
    scalar(
        pool,
        "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint".into(),
    )
    .await
}

/// Inserts `rows` rows of 300 bytes on `topic`, key `k<i>` each, by one statement.
async fn fill(pool: &PgPool, schema: &str, topic: &str, rows: u64) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {schema}.messages (message_id, topic, key, payload, headers)
         SELECT gen_random_uuid(), $2, 'k' || i, convert_to(repeat('x', 300), 'UTF8'), '{{}}'
         FROM generate_series(1, $1) AS i"
    )))
    .bind(rows as i64)
    .bind(topic)
    .execute(pool)
    .await
    .unwrap();
}

/// The reference's table: the outbox's columns a bare relay needs, PostgreSQL's defaults
/// (no fillfactor or other tuning), and one index, on the live rows in claim order.
async fn create_reference_schema(pool: &PgPool, schema: &str) {
    exec(
        pool,
        format!(
            "CREATE SCHEMA {schema};
             CREATE TABLE {schema}.messages (
                 id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 message_id uuid NOT NULL UNIQUE,
                 topic text NOT NULL,
                 key text,
                 payload bytea NOT NULL,
                 headers jsonb NOT NULL DEFAULT '{{}}',
                 occurred_at timestamptz NOT NULL DEFAULT now(),
                 available_at timestamptz NOT NULL DEFAULT now(),
                 status smallint NOT NULL DEFAULT 0,
                 attempts int NOT NULL DEFAULT 0,
                 claim_token uuid,
                 locked_until timestamptz,
                 dispatched_at timestamptz);
             CREATE INDEX ON {schema}.messages (available_at, id) WHERE status <= 1;"
        ),
    )
    .await;
}

struct Bench {
    rt: tokio::runtime::Runtime,
    pool: PgPool,
    js: async_nats::jetstream::Context,
    outbox: PathBuf,
    workdir: tempfile::TempDir,
    rows: u64,
    batch: u64,
    timeout: Duration,
}

impl Bench {
    /// One run: a fresh schema and stream, `rows` rows, `CHECKPOINT`, the child, its
    /// figures, the check that nothing live is left, and the clean-up.
    fn run(&self, who: Who, dispatch: Dispatch) -> Figures {
        let id = short_id();
        let schema = match who {
            Who::Ours => format!("bench_tp_ours_{id}"),
            Who::Reference => format!("bench_tp_ref_{id}"),
        };
        let root = format!("benchtp{id}");
        let topic = format!("{root}.orders.v1");
        let stream = root.to_uppercase();
        self.rt.block_on(async {
            CREATED.lock().unwrap().1.push(stream.clone());
            self.js
                .create_stream(async_nats::jetstream::stream::Config {
                    name: stream.clone(),
                    subjects: vec![format!("{root}.>")],
                    duplicate_window: Duration::from_secs(120),
                    ..Default::default()
                })
                .await
                .expect("NATS with JetStream must listen on 127.0.0.1:4222");
            CREATED.lock().unwrap().0.push(schema.clone());
        });
        match who {
            Who::Ours => {
                let out = child(&self.outbox, self.workdir.path())
                    .args(["--database-url", PG, "--schema", &schema, "migrate"])
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "outbox migrate failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Who::Reference => self
                .rt
                .block_on(create_reference_schema(&self.pool, &schema)),
        }
        let (pg_before, wal_before) = self.rt.block_on(async {
            fill(&self.pool, &schema, &topic, self.rows).await;
            // Statistics, as autovacuum would have taken them (it may be off here), and
            // the visibility map; then the same full-page-image cost for every run.
            exec(&self.pool, format!("VACUUM (ANALYZE) {schema}.messages")).await;
            exec(&self.pool, "CHECKPOINT".into()).await;
            (postgres_ticks(), wal_bytes(&self.pool).await)
        });

        let log = self.workdir.path().join(format!("{schema}.log"));
        let mut cmd = match who {
            Who::Ours => {
                let mut cmd = child(&self.outbox, self.workdir.path());
                cmd.args([
                    "--database-url",
                    PG,
                    "--schema",
                    &schema,
                    "relay",
                    "--drain",
                ])
                .args(["--batch-size", &self.batch.to_string()])
                .args(["--route", &format!("{root}.>={NATS}")])
                .args(["--ordered", &format!("other{id}.>")])
                .args([
                    "--on-dispatch",
                    if dispatch == Dispatch::Keep {
                        "keep"
                    } else {
                        "delete"
                    },
                ]);
                cmd
            }
            Who::Reference => {
                let mut cmd = child(&std::env::current_exe().unwrap(), self.workdir.path());
                cmd.env(
                    REFERENCE,
                    if dispatch == Dispatch::Keep {
                        "update"
                    } else {
                        "delete"
                    },
                )
                .env(REFERENCE_SCHEMA, &schema)
                .env(REFERENCE_BATCH, self.batch.to_string());
                cmd
            }
        };
        let out = std::fs::File::create(&log).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        let started = Instant::now();
        let spawned = cmd.spawn().expect("the child starts");
        let ended = wait_child(spawned.id() as i32, started, self.timeout);
        // `spawned` was reaped by wait_child; dropping it does not wait.
        drop(spawned);

        let (pg_after, wal_after, live, kept, total, published) = self.rt.block_on(async {
            let pg = postgres_ticks();
            let wal = wal_bytes(&self.pool).await;
            let count = |filter: &str| {
                scalar(
                    &self.pool,
                    format!("SELECT count(*) FROM {schema}.messages {filter}"),
                )
            };
            let live = count("WHERE status <= 1").await;
            let kept = count("WHERE status = 2").await;
            let total = count("").await;
            let published = self
                .js
                .get_stream(&stream)
                .await
                .unwrap()
                .info()
                .await
                .unwrap()
                .state
                .messages;
            (pg, wal, live, kept, total, published)
        });
        let code = exit_code(ended.status);
        let kept_expected = if dispatch == Dispatch::Keep {
            self.rows as i64
        } else {
            0
        };
        let wrong = code != Some(0)
            || live != 0
            || kept != kept_expected
            || total != kept_expected
            || published != self.rows;
        if wrong {
            println!(
                "WRONG: {} left {live} live rows ({kept} dispatched of {total} rows; {published} of {} rows in the stream; exit {code:?}): the measurement is wrong. Its output:",
                dispatch.label(who),
                self.rows
            );
            print!("{}", std::fs::read_to_string(&log).unwrap_or_default());
            cleanup(&self.rt, &self.pool, &self.js);
            std::process::exit(1);
        }
        self.rt.block_on(async {
            drop_schema(&self.pool, &schema).await;
            delete_stream(&self.js, &stream).await;
        });

        let per_100k = 100_000.0 / self.rows as f64;
        Figures {
            rate: self.rows as f64 / ended.wall.as_secs_f64(),
            relay_cpu: ended.cpu_secs * per_100k,
            pg_cpu: pg_after.saturating_sub(pg_before) as f64 / clock_ticks_per_second() * per_100k,
            wal_per_msg: (wal_after - wal_before) as f64 / self.rows as f64,
            rss_mb: ended.max_rss_kb as f64 / 1024.0,
        }
    }
}

async fn drop_schema(pool: &PgPool, schema: &str) {
    exec(pool, format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await;
    CREATED.lock().unwrap().0.retain(|s| s != schema);
}

async fn delete_stream(js: &async_nats::jetstream::Context, stream: &str) {
    let _ = js.delete_stream(stream).await;
    CREATED.lock().unwrap().1.retain(|s| s != stream);
}

/// Drops every schema and stream still listed in [`CREATED`].
fn cleanup(rt: &tokio::runtime::Runtime, pool: &PgPool, js: &async_nats::jetstream::Context) {
    let (schemas, streams) = CREATED.lock().unwrap().clone();
    rt.block_on(async {
        for s in &schemas {
            drop_schema(pool, s).await;
        }
        for s in &streams {
            delete_stream(js, s).await;
        }
    });
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn print_run(pair: usize, label: &str, f: &Figures) {
    println!(
        "pair {pair}  {label:<17} {:>8.0} msg/s   relay CPU {:>6.2} s/100k   PostgreSQL CPU {:>6.2} s/100k   WAL {:>6.0} B/msg   peak RSS {:>6.1} MB",
        f.rate, f.relay_cpu, f.pg_cpu, f.wal_per_msg, f.rss_mb
    );
}

fn main() {
    if let Ok(mode) = std::env::var(REFERENCE) {
        reference_main(&mode);
        return;
    }
    let rows = env_num("BENCH_ROWS", 100_000);
    let batch = env_num("BENCH_BATCH", 1_000);
    let pairs = env_num("BENCH_PAIRS", 3) as usize;
    let timeout = Duration::from_secs(env_num("BENCH_TIMEOUT_SECS", 1_800));
    let outbox = outbox_binary();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (pool, js) = rt.block_on(async {
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect(PG)
            .await
            .expect("PostgreSQL must listen on 127.0.0.1:5432");
        let client = async_nats::connect(NATS)
            .await
            .expect("NATS must listen on 127.0.0.1:4222");
        (pool, async_nats::jetstream::new(client))
    });
    let bench = Bench {
        rt,
        pool,
        js,
        outbox,
        workdir: tempfile::tempdir().unwrap(),
        rows,
        batch,
        timeout,
    };
    let in_flight = RelayConfig::default().in_flight_batches;
    println!(
        "table path benchmark: PostgreSQL 127.0.0.1:5432 -> NATS JetStream 127.0.0.1:4222, {rows} rows of 300 bytes (a key each) per run, batch {batch}, {pairs} pairs"
    );
    println!(
        "ours: {} relay --drain --batch-size {batch} --ordered other.> (not the rows' topics), defaults otherwise; the reference: {in_flight} claim loops (our default batches in flight)",
        bench.outbox.display()
    );
    println!("load average at the start: {}", load_average());

    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // [pair][keep, delete] = (ours, reference)
        let mut results: Vec<[(Figures, Figures); 2]> = Vec::new();
        for pair in 0..pairs {
            let mut row = [(Figures::default(), Figures::default()); 2];
            for (m, dispatch) in [Dispatch::Keep, Dispatch::Delete].into_iter().enumerate() {
                let order = if (pair + m) % 2 == 0 {
                    [Who::Reference, Who::Ours]
                } else {
                    [Who::Ours, Who::Reference]
                };
                for who in order {
                    let f = bench.run(who, dispatch);
                    print_run(pair + 1, dispatch.label(who), &f);
                    match who {
                        Who::Ours => row[m].0 = f,
                        Who::Reference => row[m].1 = f,
                    }
                }
            }
            results.push(row);
        }
        results
    }));
    cleanup(&bench.rt, &bench.pool, &bench.js);
    let Ok(results) = outcome else {
        eprintln!("the bench failed; its schemas and streams were dropped");
        std::process::exit(1);
    };
    println!("load average at the end: {}", load_average());
    print_summary(&results);
}

fn print_summary(results: &[[(Figures, Figures); 2]]) {
    let n = results.len();
    println!();
    println!(
        "summary: ours / reference (throughput above 1: ours faster; the others above 1: ours costs more); median of {n} pairs [each pair]"
    );
    println!(
        "{:<15} {:<30} {:<30} {:<30} {:<30} {:<30}",
        "mode",
        "throughput",
        "relay CPU per 100k",
        "PostgreSQL CPU per 100k",
        "WAL bytes per message",
        "peak RSS"
    );
    for (m, mode) in ["keep / UPDATE", "delete / DELETE"].into_iter().enumerate() {
        let ratios: Vec<Figures> = results.iter().map(|r| r[m].0.ratio(&r[m].1)).collect();
        let cell = |get: fn(&Figures) -> f64| {
            let each: Vec<String> = ratios.iter().map(|f| format!("{:.2}", get(f))).collect();
            format!(
                "{:.2} [{}]",
                median(ratios.iter().map(get).collect()),
                each.join(" ")
            )
        };
        println!(
            "{mode:<15} {:<30} {:<30} {:<30} {:<30} {:<30}",
            cell(|f| f.rate),
            cell(|f| f.relay_cpu),
            cell(|f| f.pg_cpu),
            cell(|f| f.wal_per_msg),
            cell(|f| f.rss_mb)
        );
    }
    println!();
    println!("medians of the figures themselves:");
    for (m, dispatch) in [Dispatch::Keep, Dispatch::Delete].into_iter().enumerate() {
        for who in [Who::Ours, Who::Reference] {
            let runs: Vec<Figures> = results
                .iter()
                .map(|r| if who == Who::Ours { r[m].0 } else { r[m].1 })
                .collect();
            let med = |get: fn(&Figures) -> f64| median(runs.iter().map(get).collect());
            println!(
                "  {:<17} {:>8.0} msg/s   relay CPU {:>6.2} s/100k   PostgreSQL CPU {:>6.2} s/100k   WAL {:>6.0} B/msg   peak RSS {:>6.1} MB",
                dispatch.label(who),
                med(|f| f.rate),
                med(|f| f.relay_cpu),
                med(|f| f.pg_cpu),
                med(|f| f.wal_per_msg),
                med(|f| f.rss_mb)
            );
        }
    }
}

/// The reference relay, in the re-executed child: `in_flight_batches` (our default) claim
/// loops over the schema in `BENCH_TABLE_PATH_SCHEMA`, each until its first empty claim.
/// `mode` is `update` (mark dispatched) or `delete`. Prints how many it dispatched.
fn reference_main(mode: &str) {
    let delete = match mode {
        "update" => false,
        "delete" => true,
        other => panic!("{REFERENCE}={other}: update or delete"),
    };
    let schema = std::env::var(REFERENCE_SCHEMA).expect("the schema");
    let batch = env_num(REFERENCE_BATCH, 1_000) as i64;
    let defaults = RelayConfig::default();
    let loops = defaults.in_flight_batches;
    let lease_ms = defaults.lease.as_millis();
    // As the CLI: a multi-threaded runtime with a worker per core.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dispatched = rt.block_on(async {
        let pool = PgPoolOptions::new()
            .max_connections(loops)
            .connect(PG)
            .await
            .unwrap();
        let js = async_nats::jetstream::new(async_nats::connect(NATS).await.unwrap());
        let claim = format!(
            "WITH due AS (SELECT id FROM {schema}.messages
                          WHERE status <= 1 AND available_at <= now()
                          ORDER BY available_at, id LIMIT $1 FOR UPDATE SKIP LOCKED)
             UPDATE {schema}.messages m SET status = 1, attempts = m.attempts + 1,
                    claim_token = $2,
                    locked_until = now() + interval '{lease_ms} milliseconds',
                    available_at = now() + interval '{lease_ms} milliseconds'
             FROM due WHERE m.id = due.id
             RETURNING m.id, m.message_id, m.topic, m.payload"
        );
        let mark = if delete {
            format!("DELETE FROM {schema}.messages WHERE id = ANY($1) AND claim_token = $2")
        } else {
            format!(
                "UPDATE {schema}.messages SET status = 2, dispatched_at = now(),
                        locked_until = NULL, claim_token = NULL
                 WHERE id = ANY($1) AND claim_token = $2"
            )
        };
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..loops {
            let (pool, js, claim, mark) = (pool.clone(), js.clone(), claim.clone(), mark.clone());
            workers.spawn(async move {
                let mut done = 0u64;
                loop {
                    let token = Uuid::new_v4();
                    let rows: Vec<(i64, Uuid, String, Vec<u8>)> =
                        sqlx::query_as(sqlx::AssertSqlSafe(claim.as_str()))
                            .bind(batch)
                            .bind(token)
                            .fetch_all(&pool)
                            .await
                            .unwrap();
                    if rows.is_empty() {
                        return done;
                    }
                    // Send the whole batch, then await every PubAck.
                    let mut ids = Vec::with_capacity(rows.len());
                    let mut acks = Vec::with_capacity(rows.len());
                    for (id, message_id, topic, payload) in rows {
                        ids.push(id);
                        let msg = PublishMessage::build()
                            .payload(payload.into())
                            .message_id(message_id.to_string());
                        acks.push(js.send_publish(topic, msg).await.unwrap());
                    }
                    for ack in acks {
                        ack.await.unwrap();
                    }
                    let marked = sqlx::query(sqlx::AssertSqlSafe(mark.as_str()))
                        .bind(&ids)
                        .bind(token)
                        .execute(&pool)
                        .await
                        .unwrap()
                        .rows_affected();
                    assert_eq!(marked, ids.len() as u64, "the claim was lost");
                    done += marked;
                }
            });
        }
        let mut total = 0;
        while let Some(done) = workers.join_next().await {
            total += done.unwrap();
        }
        pool.close().await;
        total
    });
    println!("reference ({mode}): {dispatched} messages dispatched");
}
