//! The chaos soak: producers write messages with known ids while a fault schedule drawn
//! from a seed SIGKILLs relays, restarts the database and the broker, pauses topics, purges
//! and replays; then everything drains and a checker compares the broker's contents and the
//! store's final state with what the producers committed.
//!
//! Run through `scripts/soak` (which builds this and the `outbox` binary):
//!
//! ```text
//! scripts/soak [--seed N] [--messages N] [--faults N] [--rate N] [--relays N]
//!              [--producers N] [--store postgres|mysql|sqlite] [--sink nats|rabbitmq]
//! scripts/soak --check-the-checker
//! ```
//!
//! Everything runs on private servers in a temporary directory: a NATS server with
//! JetStream or a RabbitMQ node, a PostgreSQL cluster or a MariaDB server (SQLite is a
//! file). docs/soak.md is the reader's page. The last line is
//! the verdict, `lost N, rolled-back delivered N, order violations N, outage attempts N,
//! duplicates N (…)`; the exit status is 1 unless the first four are 0 and every poison
//! message was quarantined. The same seed draws the same producers' choices and the same
//! fault schedule (the timing of the processes themselves still varies).
//!
//! What each figure means:
//! - **lost**: committed messages that are neither on the broker nor a dead letter at the
//!   end (a message still pending after the final drain counts).
//! - **rolled-back delivered**: messages of rolled-back transactions found on the broker.
//! - **order violations**: messages of an ordered key (topic `soak.ordered`, keys owned by
//!   one producer each, so commit order is id order) whose first delivery came after the
//!   first delivery of a later message of the same key.
//! - **outage attempts**: messages quarantined though not poison, plus attempts on the rows
//!   left at the end beyond what the faults that may cost an attempt explain (one per relay
//!   SIGKILL and per database restart: a claim whose relay dies keeps its attempt).
//! - **duplicates**: deliveries beyond the first of a message id, and how many of them fall
//!   within 5 s of a relay kill, a database restart or a broker stop (the windows where a
//!   confirmation was received, or sent and lost, but not yet recorded). The stream's
//!   duplicate window is 100 ms, so the broker hides almost none of them.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::Views as _;
use outbox::message::Message;
use outbox::store::{AnyStore, StoreConfig};
use uuid::Uuid;

const OUTBOX: &str = env!("CARGO_BIN_EXE_outbox");
const PG_BIN: &str = "/usr/lib/postgresql/15/bin";
/// The relays' lease (ms): short, so killed relays' rows come back within seconds.
const LEASE_MS: u64 = 3_000;
/// How long the soak drains again after a drain that left rows pending (not due yet):
/// far beyond the relays' longest retry delay (2 s backoff, 2 s breaker).
const SETTLE_AFTER_DRAIN: Duration = Duration::from_secs(30);
const PUBLISH_TIMEOUT_MS: u64 = 2_000;
/// How close (s) a duplicate's first copy must be to a fault to be counted as in its window.
const WINDOW_S: f64 = 5.0;
/// Keys of the ordered topic, per producer.
const KEYS_PER_PRODUCER: u64 = 20;

// ---------------------------------------------------------------------------------------
// Arguments and the seeded generator
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum StoreKind {
    Postgres,
    MySql,
    Sqlite,
}

#[derive(Clone, Debug)]
struct Args {
    seed: u64,
    messages: u64,
    faults: u32,
    rate: u64,
    relays: usize,
    producers: u64,
    store: StoreKind,
    sink: SinkKind,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum SinkKind {
    Nats,
    RabbitMq,
}

fn usage(why: &str) -> ! {
    eprintln!(
        "soak: {why}\nusage: scripts/soak [--seed N] [--messages N] [--faults N] [--rate N] \
         [--relays N] [--producers N] [--store postgres|mysql|sqlite] [--sink nats|rabbitmq]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut args = Args {
        seed: 1,
        messages: 20_000,
        faults: 12,
        rate: 1_000,
        relays: 3,
        producers: 4,
        store: StoreKind::Postgres,
        sink: SinkKind::Nats,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue;
        }
        let Some(value) = it.next() else {
            usage(&format!("{flag} needs a value"))
        };
        let num = |v: &str| -> u64 {
            v.replace('_', "")
                .parse()
                .unwrap_or_else(|_| usage(&format!("{flag}: not a number: {v}")))
        };
        match flag.as_str() {
            "--seed" => args.seed = num(&value),
            "--messages" => args.messages = num(&value).max(1),
            "--faults" => args.faults = u32::try_from(num(&value)).unwrap_or(u32::MAX),
            "--rate" => args.rate = num(&value).max(1),
            "--producers" => args.producers = num(&value).clamp(1, 64),
            "--relays" => args.relays = usize::try_from(num(&value)).unwrap_or(3).max(1),
            "--store" => {
                args.store = match value.as_str() {
                    "postgres" => StoreKind::Postgres,
                    "mysql" | "mariadb" => StoreKind::MySql,
                    "sqlite" => StoreKind::Sqlite,
                    other => usage(&format!("unknown store {other}")),
                }
            }
            "--sink" => {
                args.sink = match value.as_str() {
                    "nats" => SinkKind::Nats,
                    "rabbitmq" => SinkKind::RabbitMq,
                    other => usage(&format!("unknown sink {other}")),
                }
            }
            other => usage(&format!("unknown flag {other}")),
        }
    }
    args
}

/// SplitMix64: a schedule that depends on the seed alone, whatever crate versions are in
/// the lock file.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    /// True with probability `pct`%.
    fn pct(&mut self, pct: u64) -> bool {
        self.next() % 100 < pct
    }
}

// ---------------------------------------------------------------------------------------
// Processes: servers and relays
// ---------------------------------------------------------------------------------------

/// A child process with its log file, restartable with the same command.
struct Proc {
    name: String,
    make: Box<dyn Fn() -> Command + Send + Sync>,
    log: PathBuf,
    /// The log's length when the current process started: what it wrote comes after.
    log_from: u64,
    /// The signal that stops it when the soak is interrupted.
    quit: i32,
    child: Option<Child>,
}

/// Every child running now, with its `quit` signal: stopped by [`stop_everything`] when
/// the soak is interrupted (SIGINT, SIGTERM), since no destructor runs then.
static LIVE: Mutex<Vec<(i32, i32)>> = Mutex::new(Vec::new());
/// The soak's directory, removed by [`stop_everything`] unless SOAK_KEEP is set.
static DIR: Mutex<Option<PathBuf>> = Mutex::new(None);
/// Set once the soak is stopping on a signal: nothing is started any more.
static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn forget(pid: u32) {
    let pid = i32::try_from(pid).unwrap_or(0);
    LIVE.lock().expect("lock").retain(|(p, _)| *p != pid);
}

/// Stops every child the soak started (each with its quit signal, then SIGKILL after
/// 20 s) and removes the soak's directory: the interrupted soak leaves nothing running.
fn stop_everything() {
    STOPPING.store(true, Ordering::SeqCst);
    let live = std::mem::take(&mut *LIVE.lock().expect("lock"));
    for (pid, signal) in &live {
        // SAFETY: kill(2) with the pid of a child of ours.
        unsafe { libc::kill(*pid, *signal) };
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for (pid, _) in &live {
        // SAFETY: waitpid(2) on a child of ours; WNOHANG never blocks.
        while unsafe { libc::waitpid(*pid, std::ptr::null_mut(), libc::WNOHANG) } == 0 {
            if Instant::now() > deadline {
                // SAFETY: as above.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    if let Some(dir) = DIR.lock().expect("lock").take()
        && std::env::var_os("SOAK_KEEP").is_none()
    {
        let _ = std::fs::remove_dir_all(dir);
    }
}

impl Proc {
    fn new(
        name: impl Into<String>,
        log: PathBuf,
        make: impl Fn() -> Command + Send + Sync + 'static,
    ) -> Self {
        Proc {
            name: name.into(),
            make: Box::new(make),
            log,
            log_from: 0,
            quit: libc::SIGKILL,
            child: None,
        }
    }

    /// Stops it with `signal` when the soak is interrupted (default SIGKILL).
    fn quit_with(mut self, signal: i32) -> Self {
        self.quit = signal;
        self
    }

    fn start(&mut self) {
        if STOPPING.load(Ordering::SeqCst) {
            return;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        self.log_from = log.metadata().map_or(0, |m| m.len());
        let err = log.try_clone().expect("log file");
        let child = (self.make)()
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.name));
        LIVE.lock()
            .expect("lock")
            .push((i32::try_from(child.id()).expect("pid"), self.quit));
        self.child = Some(child);
    }

    /// Sends `signal` and waits for the process to exit (SIGKILL after 30 s).
    fn stop(&mut self, signal: i32) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        forget(child.id());
        let pid = i32::try_from(child.id()).expect("pid");
        // SAFETY: kill(2) with a pid of our own child.
        unsafe { libc::kill(pid, signal) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What the current (or last) process wrote to its log.
    fn said(&self) -> String {
        let all = std::fs::read(&self.log).unwrap_or_default();
        let from = usize::try_from(self.log_from).unwrap_or(0).min(all.len());
        String::from_utf8_lossy(&all[from..]).into_owned()
    }

    /// The exit status when the process has exited on its own.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        if let Some(child) = self.child.take() {
            forget(child.id());
        }
        Some(status)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop(libc::SIGKILL);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a free port")
        .local_addr()
        .expect("its address")
        .port()
}

async fn wait_port(what: &str, port: u16, timeout: Duration) {
    let start = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            start.elapsed() < timeout,
            "{what} did not listen on {port} within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ids_of(user: &str) -> (u32, u32) {
    let id = |flag: &str| {
        let out = Command::new("id").args([flag, user]).output().expect("id");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<u32>()
            .unwrap_or_else(|_| panic!("no user {user} on this machine"))
    };
    (id("-u"), id("-g"))
}

/// The database the soak runs on: a private server (restartable) or a SQLite file.
struct Database {
    url: String,
    server: Option<Proc>,
    port: u16,
    kind: StoreKind,
}

impl Database {
    async fn start(kind: StoreKind, dir: &Path) -> Self {
        match kind {
            StoreKind::Sqlite => Database {
                url: format!("sqlite://{}", dir.join("soak.db").display()),
                server: None,
                port: 0,
                kind,
            },
            StoreKind::Postgres => Self::postgres(dir).await,
            StoreKind::MySql => Self::mariadb(dir).await,
        }
    }

    async fn postgres(dir: &Path) -> Self {
        let d = dir.join("pg");
        std::fs::create_dir_all(&d).expect("pg dir");
        // PostgreSQL refuses to run as root.
        let owner = (unsafe { libc::geteuid() } == 0).then(|| ids_of("postgres"));
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&d, Some(uid), Some(gid)).expect("chown");
        }
        let data = d.join("data");
        let mut initdb = Command::new(format!("{PG_BIN}/initdb"));
        if let Some((uid, gid)) = owner {
            initdb.uid(uid).gid(gid);
        }
        let out = initdb
            .current_dir(&d)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale"])
            .args(["--no-sync", "--no-instructions", "-D"])
            .arg(&data)
            .output()
            .expect("initdb (Debian's postgresql-15)");
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port();
        let (data2, d2) = (data.clone(), d.clone());
        let mut server = Proc::new("postgres", d.join("postgres.log"), move || {
            let mut cmd = Command::new(format!("{PG_BIN}/postgres"));
            if let Some((uid, gid)) = owner {
                cmd.uid(uid).gid(gid);
            }
            cmd.current_dir(&d2)
                .arg("-D")
                .arg(&data2)
                .arg("-k")
                .arg(&d2)
                .args(["-p", &port.to_string()])
                .args(["-c", "listen_addresses=127.0.0.1"])
                .args(["-c", "max_connections=200"])
                .args(["-c", "logging_collector=off"]);
            cmd
        })
        .quit_with(libc::SIGINT);
        server.start();
        let db = Database {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            server: Some(server),
            port,
            kind: StoreKind::Postgres,
        };
        db.wait_ready().await;
        db
    }

    async fn mariadb(dir: &Path) -> Self {
        let d = dir.join("mariadb");
        let data = d.join("data");
        std::fs::create_dir_all(&d).expect("mariadb dir");
        let out = Command::new("mariadb-install-db")
            .args(["--no-defaults", "--auth-root-authentication-method=normal"])
            .args(["--user=root", "--skip-test-db"])
            .arg(format!("--datadir={}", data.display()))
            .stdin(Stdio::null())
            .output()
            .expect("mariadb-install-db (Debian's mariadb-server)");
        assert!(
            out.status.success(),
            "mariadb-install-db: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port();
        let d2 = d.clone();
        let mut server = Proc::new("mariadbd", d.join("mariadbd.log"), move || {
            let mut cmd = Command::new("/usr/sbin/mariadbd");
            cmd.current_dir(&d2)
                .args(["--no-defaults", "--user=root", "--skip-name-resolve"])
                .arg(format!("--datadir={}", d2.join("data").display()))
                .arg(format!("--socket={}", d2.join("mysqld.sock").display()))
                .arg(format!("--pid-file={}", d2.join("mysqld.pid").display()))
                .arg(format!("--port={port}"))
                .args(["--skip-networking=0", "--bind-address=127.0.0.1"])
                .args(["--innodb-buffer-pool-size=64M", "--max-connections=300"]);
            cmd
        })
        .quit_with(libc::SIGTERM);
        server.start();
        wait_port("mariadbd", port, Duration::from_secs(60)).await;
        let socket = d.join("mysqld.sock");
        let admin = sqlx::mysql::MySqlConnectOptions::new()
            .socket(&socket)
            .username("root")
            .ssl_mode(sqlx::mysql::MySqlSslMode::Disabled);
        let start = Instant::now();
        let mut conn = loop {
            match sqlx::ConnectOptions::connect(&admin).await {
                Ok(c) => break c,
                Err(e) if start.elapsed() > Duration::from_secs(60) => {
                    panic!("private mariadbd: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        for sql in [
            "CREATE DATABASE soak",
            "CREATE USER soak@'%'",
            "GRANT ALL ON soak.* TO soak@'%'",
        ] {
            sqlx::raw_sql(sql).execute(&mut conn).await.expect(sql);
        }
        let db = Database {
            url: format!("mysql://soak@127.0.0.1:{port}/soak"),
            server: Some(server),
            port,
            kind: StoreKind::MySql,
        };
        db.wait_ready().await;
        db
    }

    async fn wait_ready(&self) {
        let start = Instant::now();
        loop {
            match AnyStore::connect(&self.url, StoreConfig::default()).await {
                Ok(_) => return,
                Err(e) if start.elapsed() > Duration::from_secs(60) => {
                    panic!("the private database did not come back: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Whether this database can be restarted (a private server; SQLite is a file).
    fn restartable(&self) -> bool {
        self.server.is_some()
    }

    /// Stops the server as a crash would (PostgreSQL: immediate shutdown, recovery on the
    /// next start; MariaDB: SIGKILL, InnoDB recovery).
    fn crash(&mut self) {
        let signal = match self.kind {
            StoreKind::Postgres => libc::SIGQUIT,
            _ => libc::SIGKILL,
        };
        if let Some(server) = self.server.as_mut() {
            server.stop(signal);
        }
    }

    async fn restart(&mut self) {
        if let Some(server) = self.server.as_mut() {
            server.start();
        }
        if self.kind != StoreKind::Sqlite {
            wait_port("the database", self.port, Duration::from_secs(60)).await;
        }
        self.wait_ready().await;
    }

    /// The messages table as SQL, and how its message id reads as text.
    /// The store over this database, as the checker opens it.
    async fn store(&self) -> outbox::Result<AnyStore> {
        AnyStore::connect(&self.url, StoreConfig::default()).await
    }

    fn messages(&self) -> (&'static str, &'static str) {
        match self.kind {
            StoreKind::Postgres => ("outbox.messages", "message_id::text"),
            StoreKind::MySql | StoreKind::Sqlite => ("outbox_messages", "message_id"),
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if self.proc.child.is_some() {
            self.stop();
        }
    }
}

/// The broker: a private NATS server with JetStream (stream `SOAK` on `soak.>`, file
/// storage, a 100 ms duplicate window) or a private RabbitMQ node (topic exchange `soak`,
/// durable queue `soak` bound to `soak.#`).
struct Broker {
    kind: SinkKind,
    proc: Proc,
    port: u16,
    /// RabbitMQ: the node's name and environment, for `rabbitmqctl`.
    node: Option<(String, Vec<(String, PathBuf)>)>,
}

impl Broker {
    async fn start(kind: SinkKind, dir: &Path) -> Self {
        let port = free_port();
        let mut broker = match kind {
            SinkKind::Nats => {
                let store = dir.join("jetstream");
                let bin = std::env::var("OUTBOX_TEST_NATS_SERVER")
                    .unwrap_or_else(|_| "/usr/sbin/nats-server".to_owned());
                let proc = Proc::new("nats-server", dir.join("nats.log"), move || {
                    let mut cmd = Command::new(&bin);
                    cmd.args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
                        .arg(&store);
                    cmd
                })
                .quit_with(libc::SIGTERM);
                Broker {
                    kind,
                    proc,
                    port,
                    node: None,
                }
            }
            SinkKind::RabbitMq => {
                let d = dir.join("rabbitmq");
                for sub in ["mnesia", "log"] {
                    std::fs::create_dir_all(d.join(sub)).expect("rabbitmq dir");
                }
                std::fs::write(d.join("plugins"), "[].").expect("plugins");
                std::fs::write(
                    d.join("rabbitmq.conf"),
                    format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n"),
                )
                .expect("rabbitmq.conf");
                // The server drops to the rabbitmq user: it must own its directories.
                let _ = Command::new("chown")
                    .args(["-R", "rabbitmq:rabbitmq"])
                    .arg(&d)
                    .status();
                let name = format!("outbox-soak-{port}@localhost");
                let env: Vec<(String, PathBuf)> = vec![
                    ("RABBITMQ_NODENAME".into(), name.clone().into()),
                    ("RABBITMQ_DIST_PORT".into(), free_port().to_string().into()),
                    ("RABBITMQ_CONFIG_FILE".into(), d.join("rabbitmq.conf")),
                    ("RABBITMQ_MNESIA_BASE".into(), d.join("mnesia")),
                    ("RABBITMQ_LOG_BASE".into(), d.join("log")),
                    ("RABBITMQ_ENABLED_PLUGINS_FILE".into(), d.join("plugins")),
                ];
                let env2 = env.clone();
                let proc = Proc::new("rabbitmq-server", d.join("server.log"), move || {
                    let mut cmd = Command::new("rabbitmq-server");
                    cmd.envs(env2.iter().map(|(k, v)| (k, v)));
                    cmd
                })
                .quit_with(libc::SIGTERM);
                Broker {
                    kind,
                    proc,
                    port,
                    node: Some((name, env)),
                }
            }
        };
        broker.restart().await;
        broker
    }

    fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The relays' route for `soak.>`.
    fn route(&self) -> String {
        match self.kind {
            SinkKind::Nats => format!("soak.>=nats://127.0.0.1:{}", self.port),
            SinkKind::RabbitMq => format!("soak.>={}?exchange=soak", self.amqp_url()),
        }
    }

    /// Starts the broker and waits until it takes clients.
    async fn restart(&mut self) {
        self.proc.start();
        wait_port(&self.proc.name, self.port, Duration::from_secs(120)).await;
        if self.kind == SinkKind::RabbitMq {
            let start = Instant::now();
            // Each attempt is bounded: a booting node may accept and never answer.
            while !matches!(
                tokio::time::timeout(
                    Duration::from_secs(5),
                    lapin::Connection::connect(
                        &self.amqp_url(),
                        lapin::ConnectionProperties::default()
                    ),
                )
                .await,
                Ok(Ok(_))
            ) {
                assert!(
                    start.elapsed() < Duration::from_secs(120),
                    "the private RabbitMQ node did not come up"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    /// Stops the broker as an operator would (NATS: SIGTERM; RabbitMQ: `rabbitmqctl stop`).
    fn stop(&mut self) {
        if let Some((name, env)) = &self.node {
            let _ = Command::new("rabbitmqctl")
                .envs(env.iter().map(|(k, v)| (k, v)))
                .args(["-n", name, "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        self.proc.stop(libc::SIGTERM);
    }

    /// The stream or the exchange and queue the relays publish to.
    async fn setup(&self) {
        match self.kind {
            SinkKind::Nats => {
                let client = async_nats::connect(format!("127.0.0.1:{}", self.port))
                    .await
                    .expect("nats");
                async_nats::jetstream::new(client)
                    .create_stream(async_nats::jetstream::stream::Config {
                        name: "SOAK".into(),
                        subjects: vec!["soak.>".into()],
                        storage: async_nats::jetstream::stream::StorageType::File,
                        duplicate_window: Duration::from_millis(100),
                        ..Default::default()
                    })
                    .await
                    .expect("stream SOAK");
            }
            SinkKind::RabbitMq => {
                use lapin::options::{
                    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
                };
                use lapin::types::FieldTable;
                let conn = lapin::Connection::connect(
                    &self.amqp_url(),
                    lapin::ConnectionProperties::default(),
                )
                .await
                .expect("rabbitmq");
                let ch = conn.create_channel().await.expect("channel");
                let durable = |d: bool| ExchangeDeclareOptions {
                    durable: d,
                    ..ExchangeDeclareOptions::default()
                };
                ch.exchange_declare(
                    "soak".into(),
                    lapin::ExchangeKind::Topic,
                    durable(true),
                    FieldTable::default(),
                )
                .await
                .expect("exchange soak");
                ch.queue_declare(
                    "soak".into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .expect("queue soak");
                ch.queue_bind(
                    "soak".into(),
                    "soak".into(),
                    "soak.#".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("binding");
            }
        }
    }

    /// Everything the broker holds, in its order.
    async fn read(&self) -> Vec<Delivery> {
        match self.kind {
            SinkKind::Nats => read_stream(self.port).await,
            SinkKind::RabbitMq => {
                use lapin::options::BasicGetOptions;
                let conn = lapin::Connection::connect(
                    &self.amqp_url(),
                    lapin::ConnectionProperties::default(),
                )
                .await
                .expect("rabbitmq");
                let ch = conn.create_channel().await.expect("channel");
                let mut out = Vec::new();
                while let Some(got) = ch
                    .basic_get("soak".into(), BasicGetOptions { no_ack: true })
                    .await
                    .expect("basic.get")
                {
                    let d = &got.delivery;
                    out.push(Delivery {
                        id: d
                            .properties
                            .message_id()
                            .as_ref()
                            .map(|s| s.as_str().to_owned())
                            .unwrap_or_default(),
                        body_id: String::from_utf8_lossy(&d.data).into_owned(),
                        at: None,
                    });
                }
                out
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The ledger: what the producers did
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fate {
    Committed,
    RolledBack,
    /// The commit call failed (the database went away during it): committed or not.
    Uncertain,
}

#[derive(Clone, Debug)]
struct Written {
    fate: Fate,
    poison: bool,
    /// (key, position among the key's messages in commit order) on the ordered topic.
    ordered: Option<(String, u64)>,
    /// Unix time (s) the message becomes due.
    due_at: f64,
}

type Ledger = Arc<Mutex<HashMap<Uuid, Written>>>;

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

/// One producer: transactions of 1 to 20 messages (one in two holds one), one in ten
/// rolled back; messages plain, keyed on the ordered topic (keys this producer alone
/// writes), delayed 1–4 s, or poison (a topic no route takes). Paced at `rate` messages/s.
/// The producers' counts, shared with the fault runner and the summary.
#[derive(Default)]
struct Tally {
    /// Messages written (committed, rolled back or unknown).
    written: AtomicU64,
    /// Transactions that failed and were tried again, or whose commit failed.
    errors: AtomicU64,
}

async fn produce(
    store: AnyStore,
    (p, producers): (u64, u64),
    count: u64,
    rate: u64,
    mut rng: Rng,
    ledger: Ledger,
    tally: Arc<Tally>,
) {
    let started = Instant::now();
    let mut positions: HashMap<u64, u64> = HashMap::new();
    let mut written = 0;
    while written < count {
        let n = if rng.pct(50) { 1 } else { rng.range(2, 20) }.min(count - written);
        let rollback = rng.pct(10);
        let mut batch = Vec::new();
        for _ in 0..n {
            let id = Uuid::now_v7();
            let roll = rng.range(0, 999);
            let (msg, written_as) = if roll < 5 {
                (
                    Message::new("poison.bad", id.to_string()),
                    (true, None, 0.0),
                )
            } else if roll < 405 {
                let k = p + producers * rng.range(0, KEYS_PER_PRODUCER - 1);
                let key = format!("k{k}");
                (
                    Message::new("soak.ordered", id.to_string()).key(key.clone()),
                    (false, Some((k, key)), 0.0),
                )
            } else if roll < 455 {
                let delay = rng.range(1_000, 4_000);
                (
                    Message::new("soak.plain", id.to_string()).delay(Duration::from_millis(delay)),
                    (false, None, delay as f64 / 1000.0),
                )
            } else {
                let mut m = Message::new("soak.plain", id.to_string());
                if rng.pct(50) {
                    m = m.key(format!("u{}", rng.range(0, 99)));
                }
                (m, (false, None, 0.0))
            };
            batch.push((id, msg.message_id(id), written_as));
        }
        // Retry the transaction until it ends; a failure before the commit leaves nothing.
        loop {
            match write(&store, &batch, rollback).await {
                Ok(()) => {
                    record(
                        &ledger,
                        &mut positions,
                        &batch,
                        if rollback {
                            Fate::RolledBack
                        } else {
                            Fate::Committed
                        },
                    );
                    break;
                }
                Err(WriteError::AtCommit) => {
                    record(&ledger, &mut positions, &batch, Fate::Uncertain);
                    tally.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(WriteError::Before) => {
                    tally.errors.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        written += n;
        tally.written.fetch_add(n, Ordering::Relaxed);
        let due = Duration::from_secs_f64(written as f64 / rate as f64);
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}

type Planned = (Uuid, Message, (bool, Option<(u64, String)>, f64));

fn record(ledger: &Ledger, positions: &mut HashMap<u64, u64>, batch: &[Planned], fate: Fate) {
    let now = unix_now();
    let mut ledger = ledger.lock().expect("lock");
    for (id, _, (poison, ordered, delay)) in batch {
        let ordered = ordered.as_ref().map(|(k, key)| {
            let pos = positions.entry(*k).or_default();
            // Only messages that may have committed take a position in their key's order.
            if fate != Fate::RolledBack {
                *pos += 1;
            }
            (key.clone(), *pos)
        });
        ledger.insert(
            *id,
            Written {
                fate,
                poison: *poison,
                ordered,
                due_at: now + delay,
            },
        );
    }
}

enum WriteError {
    Before,
    AtCommit,
}

/// Writes `batch` in one transaction of the store's own kind, as a service would.
async fn write(store: &AnyStore, batch: &[Planned], rollback: bool) -> Result<(), WriteError> {
    macro_rules! tx {
        ($s:expr) => {{
            let mut tx = $s.pool().begin().await.map_err(|_| WriteError::Before)?;
            for (_, msg, _) in batch {
                $s.enqueue(&mut tx, msg)
                    .await
                    .map_err(|_| WriteError::Before)?;
            }
            if rollback {
                tx.rollback().await.map_err(|_| WriteError::Before)
            } else {
                tx.commit().await.map_err(|_| WriteError::AtCommit)
            }
        }};
    }
    match store {
        AnyStore::Postgres(s) => tx!(s),
        AnyStore::MySql(s) => tx!(s),
        AnyStore::Sqlite(s) => tx!(s),
        _ => unreachable!("the CLI's library has three stores"),
    }
}

// ---------------------------------------------------------------------------------------
// The fault schedule
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Fault {
    /// SIGKILL relay `n`, restart it after `down` ms.
    KillRelay { relay: usize, down: u64 },
    /// Crash the database, start it again after `down` ms.
    RestartDatabase { down: u64 },
    /// Stop the broker (SIGTERM), start it again after `down` ms.
    StopBroker { down: u64 },
    /// Pause `soak.plain` for `ms`.
    PauseTopic { ms: u64 },
    /// `outbox purge --older-than 1s --yes`.
    Purge,
    /// `outbox replay --topic 'poison.>'`.
    ReplayDead,
}

fn schedule(args: &Args, rng: &mut Rng, restartable_db: bool) -> Vec<(u64, Fault)> {
    // Faults fire by the producers' progress (messages written), so they spread over the
    // production however fast it goes.
    let last = args.messages.saturating_sub(1).max(1);
    let mut faults: Vec<(u64, Fault)> = (0..args.faults)
        .map(|_| {
            let at = rng.range(args.messages / 20, last);
            let fault = match rng.range(0, 99) {
                0..=34 => Fault::KillRelay {
                    relay: usize::try_from(
                        rng.range(0, u64::try_from(args.relays - 1).unwrap_or(0)),
                    )
                    .unwrap_or(0),
                    down: rng.range(0, 3_000),
                },
                35..=49 if restartable_db => Fault::RestartDatabase {
                    down: rng.range(200, 3_000),
                },
                35..=64 => Fault::StopBroker {
                    down: rng.range(500, 6_000),
                },
                65..=79 => Fault::PauseTopic {
                    ms: rng.range(500, 5_000),
                },
                80..=89 => Fault::Purge,
                _ => Fault::ReplayDead,
            };
            (at, fault)
        })
        .collect();
    faults.sort_by_key(|(at, _)| *at);
    faults
}

/// What happened, with wall-clock times (unix s), for the duplicates' windows.
#[derive(Default)]
struct Happened {
    /// (start, end) of every relay kill, database restart and broker stop.
    windows: Vec<(f64, f64)>,
    kills: u64,
    db_restarts: u64,
    broker_stops: u64,
    pauses: u64,
    purges: u64,
    replays: u64,
    /// Relays that exited on their own, with their exit status.
    relay_exits: Vec<String>,
    cli_failures: Vec<String>,
    /// Message ids a relay logged as "lost the claim on these rows": its lease ran out
    /// (a relay too slow to renew, the database locked or down) and another relay claimed
    /// them, so a confirmation it held was not recorded.
    lost_claims: std::collections::HashSet<String>,
}

/// The message ids of the relays' "lost the claim" lines in the logs under `dir`.
fn lost_claims_in_logs(dir: &Path) -> std::collections::HashSet<String> {
    let mut ids = std::collections::HashSet::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return ids;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("relay-") || name.starts_with("drain-")) {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for line in text.lines().filter(|l| l.contains("lost the claim")) {
            if let Some((_, rest)) = line.split_once("message_ids=") {
                let list = rest.split_whitespace().next().unwrap_or("");
                ids.extend(list.split(',').filter(|s| !s.is_empty()).map(str::to_owned));
            }
        }
    }
    ids
}

struct World {
    db: tokio::sync::Mutex<Database>,
    broker: tokio::sync::Mutex<Broker>,
    relays: Vec<tokio::sync::Mutex<Proc>>,
    happened: Mutex<Happened>,
}

fn relay_command(db_url: &str, route: &str, name: &str, drain: bool) -> Command {
    let mut cmd = Command::new(OUTBOX);
    cmd.arg("relay")
        .args(["--database-url", db_url])
        .args(["--route", route])
        .args(["--ordered", "soak.ordered"])
        .args(["--lease-ms", &LEASE_MS.to_string()])
        .args(["--publish-timeout-ms", &PUBLISH_TIMEOUT_MS.to_string()])
        .args(["--backoff-base-ms", "200", "--backoff-max-ms", "2000"])
        .args(["--max-attempts", "100"])
        .args(["--poll-interval-ms", "250", "--summary-interval-s", "0"])
        .args(["--shutdown-grace-ms", "2000", "--batch-size", "500"])
        .args(["--relay-id", name])
        .env("RUST_LOG", "warn");
    if drain {
        cmd.arg("--drain-wait-leases");
    }
    cmd
}

/// Runs an admin command of the CLI; a failure is noted (a database restarting may refuse
/// it), not fatal. `Err` holds its stderr.
async fn admin(world: &World, db_url: &str, args: &[&str]) -> Result<(), String> {
    let mut cmd = tokio::process::Command::new(OUTBOX);
    cmd.args(args)
        .args(["--database-url", db_url])
        .kill_on_drop(true);
    let out = cmd
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {OUTBOX}: {e}"));
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    if err.contains("no topic pause") {
        // A resume of a pause that is not there: nothing was refused.
        return Err(err);
    }
    world
        .happened
        .lock()
        .expect("lock")
        .cli_failures
        .push(format!("outbox {}: {err}", args.join(" ")));
    Err(err)
}

impl World {
    /// Counts a fault that began at `t0` (unix s) and ended now, and keeps its window for
    /// placing the duplicates.
    fn outage_ended(&self, t0: f64, count: impl FnOnce(&mut Happened)) {
        let mut h = self.happened.lock().expect("lock");
        count(&mut h);
        h.windows.push((t0, unix_now()));
    }
}

async fn inject(world: Arc<World>, db_url: String, fault: Fault) {
    match fault {
        Fault::KillRelay { relay, down } => {
            let mut r = world.relays[relay].lock().await;
            let t0 = unix_now();
            r.stop(libc::SIGKILL);
            tokio::time::sleep(Duration::from_millis(down)).await;
            r.start();
            world.outage_ended(t0, |h| h.kills += 1);
        }
        Fault::RestartDatabase { down } => {
            let mut db = world.db.lock().await;
            let t0 = unix_now();
            db.crash();
            tokio::time::sleep(Duration::from_millis(down)).await;
            db.restart().await;
            world.outage_ended(t0, |h| h.db_restarts += 1);
        }
        Fault::StopBroker { down } => {
            let mut b = world.broker.lock().await;
            let t0 = unix_now();
            b.stop();
            tokio::time::sleep(Duration::from_millis(down)).await;
            b.restart().await;
            world.outage_ended(t0, |h| h.broker_stops += 1);
        }
        Fault::PauseTopic { ms } => {
            let paused = admin(
                &world,
                &db_url,
                &[
                    "pause",
                    "--topic",
                    "soak.plain",
                    "--reason",
                    "soak",
                    "--by",
                    "soak",
                ],
            )
            .await;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            // A resume that failed while the database restarted is tried again (a topic
            // left paused would hold its messages past the drain); one that finds no such
            // pause is done.
            if paused.is_ok() {
                for _ in 0..120 {
                    match admin(
                        &world,
                        &db_url,
                        &["resume", "--topic", "soak.plain", "--by", "soak"],
                    )
                    .await
                    {
                        Err(e) if !e.contains("no topic pause") => {
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                        _ => break,
                    }
                }
            }
            world.happened.lock().expect("lock").pauses += 1;
        }
        Fault::Purge => {
            let _ = admin(&world, &db_url, &["purge", "--older-than", "1s", "--yes"]).await;
            world.happened.lock().expect("lock").purges += 1;
        }
        Fault::ReplayDead => {
            let _ = admin(
                &world,
                &db_url,
                &[
                    "replay", "--topic", "poison.>", "--reason", "soak", "--by", "soak", "--yes",
                ],
            )
            .await;
            world.happened.lock().expect("lock").replays += 1;
        }
    }
}

// ---------------------------------------------------------------------------------------
// The checker
// ---------------------------------------------------------------------------------------

struct Delivery {
    id: String,
    body_id: String,
    /// When the broker stored it (unix s); RabbitMQ keeps no such time.
    at: Option<f64>,
}

async fn read_stream(port: u16) -> Vec<Delivery> {
    let client = async_nats::connect(format!("127.0.0.1:{port}"))
        .await
        .expect("the private nats-server");
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream("SOAK").await.expect("stream SOAK");
    let info = stream.info().await.expect("stream info").clone();
    let (first, last) = (info.state.first_sequence, info.state.last_sequence);
    if info.state.messages == 0 {
        return Vec::new();
    }
    let chunks = 8u64;
    let per = (last - first + 1).div_ceil(chunks);
    let mut tasks = Vec::new();
    for c in 0..chunks {
        let stream = stream.clone();
        let (lo, hi) = (first + c * per, (first + (c + 1) * per - 1).min(last));
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for seq in lo..=hi {
                let m = stream.get_raw_message(seq).await.expect("stream message");
                out.push(Delivery {
                    id: m
                        .headers
                        .get("Nats-Msg-Id")
                        .map(|v| v.as_str().to_owned())
                        .unwrap_or_default(),
                    body_id: String::from_utf8_lossy(&m.payload).into_owned(),
                    at: Some(m.time.unix_timestamp_nanos() as f64 / 1e9),
                });
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("reader"));
    }
    all
}

/// A row of the messages table at the end: (logical state, attempts).
/// `sqlx::query_as(sql).fetch_all(…)` on the pool of whichever store `$store` (an
/// [`AnyStore`]) is; the row type comes from the caller.
macro_rules! fetch_all {
    ($store:expr, $sql:expr) => {
        match &$store {
            AnyStore::Postgres(s) => {
                sqlx::query_as(sqlx::AssertSqlSafe($sql))
                    .fetch_all(s.pool())
                    .await
            }
            AnyStore::MySql(s) => {
                sqlx::query_as(sqlx::AssertSqlSafe($sql))
                    .fetch_all(s.pool())
                    .await
            }
            AnyStore::Sqlite(s) => {
                sqlx::query_as(sqlx::AssertSqlSafe($sql))
                    .fetch_all(s.pool())
                    .await
            }
            _ => unreachable!("the soak opens PostgreSQL, MariaDB or SQLite"),
        }
    };
}

/// The rows still live (pending or claimed) at the end, grouped by topic, state, attempts,
/// whether they are due and the start of their last error: what a failed verdict needs to
/// say why they were not delivered.
async fn live_rows_detail(db: &Database) -> Vec<String> {
    let (table, _) = db.messages();
    let state = "CASE WHEN claim_token IS NULL THEN 'pending' ELSE 'claimed' END";
    // Per dialect: the clock, the text of "due in N s", the text type.
    let sqlite_now = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";
    let (now, due_in, text) = match db.kind {
        StoreKind::Postgres => (
            "now()",
            "'due in ' || ceil(extract(epoch FROM max(available_at) - now()))::text || ' s'"
                .to_owned(),
            "TEXT",
        ),
        StoreKind::MySql => (
            "now(6)",
            "concat('due in ', ceil(timestampdiff(microsecond, now(6), max(available_at)) / 1e6), ' s')"
                .to_owned(),
            "CHAR",
        ),
        StoreKind::Sqlite => (
            sqlite_now,
            format!("'due in ' || ((max(available_at) - {sqlite_now}) / 1000 + 1) || ' s'"),
            "TEXT",
        ),
    };
    let due = format!("CASE WHEN max(available_at) <= {now} THEN 'due' ELSE {due_in} END");
    let lease = format!("coalesce(max(CASE WHEN locked_until > {now} THEN 1 ELSE 0 END), 0)");
    let sql = format!(
        "SELECT CAST(topic AS {text}), CAST({state} AS {text}), CAST(attempts AS {text}), \
                CAST({due} AS {text}), CAST({lease} AS {text}), \
                CAST(coalesce(substr(max(last_error), 1, 120), '') AS {text}), \
                CAST(count(*) AS {text}) \
         FROM {table} WHERE status <= 1 \
         GROUP BY topic, {state}, attempts ORDER BY count(*) DESC LIMIT 20"
    );
    type Row = (String, String, String, String, String, String, String);
    let rows: Result<Vec<Row>, sqlx::Error> = match db.store().await {
        Ok(store) => fetch_all!(store, sql),
        Err(e) => return vec![format!("cannot open the store: {e}")],
    };
    match rows {
        Ok(rows) => rows
            .into_iter()
            .map(|(topic, state, attempts, due, leased, err, n)| {
                format!(
                    "{n} × {topic} {state}, attempts {attempts}, {due}{}{}",
                    if leased == "1" {
                        ", under a live lease"
                    } else {
                        ""
                    },
                    if err.is_empty() {
                        String::new()
                    } else {
                        format!(", last error: {err}")
                    }
                )
            })
            .collect(),
        Err(e) => vec![format!("cannot read the live rows: {e}")],
    }
}

async fn read_rows(db: &Database) -> HashMap<String, (i64, i64)> {
    let (table, id) = db.messages();
    let state = "CASE WHEN status <= 1 THEN CASE WHEN claim_token IS NULL THEN 0 ELSE 1 END ELSE status END";
    let sql = match db.kind {
        StoreKind::Postgres => {
            format!("SELECT {id}, ({state})::bigint, attempts::bigint FROM {table}")
        }
        StoreKind::MySql => {
            format!("SELECT {id}, CAST({state} AS SIGNED), CAST(attempts AS SIGNED) FROM {table}")
        }
        StoreKind::Sqlite => format!("SELECT {id}, {state}, attempts FROM {table}"),
    };
    let store = db.store().await.expect("store");
    let rows: Vec<(String, i64, i64)> = fetch_all!(store, sql).expect("messages");
    rows.into_iter()
        .map(|(id, state, attempts)| (id, (state, attempts)))
        .collect()
}

// ---------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------

/// `[  12.3s]`: the time since `started`, for the soak's lines.
fn stamp_at(started: Instant) -> String {
    format!("[{:>6.1}s]", started.elapsed().as_secs_f64())
}

/// `--check-the-checker`: runs [`check`] on a made-up history holding one of each defect
/// and fails unless each is reported, so the verdict of a real run is known to be able to
/// say no.
fn check_the_checker() -> i32 {
    let id = |n: u128| Uuid::from_u128(n);
    let written = |fate, poison, ordered: Option<(&str, u64)>| Written {
        fate,
        poison,
        ordered: ordered.map(|(k, p)| (k.to_owned(), p)),
        due_at: 0.0,
    };
    let ledger: HashMap<Uuid, Written> = [
        (id(1), written(Fate::Committed, false, None)), // delivered once
        (id(2), written(Fate::Committed, false, None)), // lost: nowhere
        (id(3), written(Fate::Committed, false, None)), // lost: marked, not on the broker
        (id(4), written(Fate::RolledBack, false, None)), // rolled back, delivered
        (id(5), written(Fate::Committed, false, Some(("k", 1)))), // delivered after #2
        (id(6), written(Fate::Committed, false, Some(("k", 2)))),
        (id(7), written(Fate::Committed, false, None)), // quarantined, not poison
        (id(8), written(Fate::Committed, false, None)), // delivered twice
        (id(9), written(Fate::Committed, true, None)),  // poison, quarantined
        (id(10), written(Fate::Committed, true, None)), // poison, left pending
        (id(11), written(Fate::Uncertain, false, None)), // never committed: not lost
        (id(12), written(Fate::Committed, false, None)), // dispatched with 5 attempts
    ]
    .into_iter()
    .collect();
    let delivery = |n: u128, at: f64| Delivery {
        id: id(n).to_string(),
        body_id: id(n).to_string(),
        at: Some(at),
    };
    let deliveries = vec![
        delivery(1, 10.0),
        delivery(4, 11.0),
        delivery(6, 12.0),
        delivery(5, 13.0),
        delivery(8, 14.0),
        delivery(8, 40.0),
        delivery(12, 15.0),
        delivery(13, 30.0),
        delivery(13, 31.0),
    ];
    let rows: HashMap<String, (i64, i64)> = [
        (id(3).to_string(), (2, 1)),
        (id(7).to_string(), (3, 100)),
        (id(9).to_string(), (3, 1)),
        (id(10).to_string(), (0, 1)),
        (id(12).to_string(), (2, 5)),
    ]
    .into_iter()
    .collect();
    let happened = Happened {
        windows: vec![(12.0, 13.0)],
        kills: 2,
        lost_claims: [id(13).to_string()].into_iter().collect(),
        ..Happened::default()
    };
    let f = check(&ledger, &deliveries, &rows, &happened);
    let mut lost = f.lost.clone();
    lost.sort();
    let expect = [
        (
            "lost",
            format!("{lost:?}"),
            format!("{:?}", [id(2).to_string(), id(3).to_string()]),
        ),
        (
            "rolled-back delivered",
            f.rolled_back_delivered.len().to_string(),
            "1".into(),
        ),
        (
            "order violations",
            f.order_violations.to_string(),
            "1".into(),
        ),
        // #7 quarantined, and #12's 5 attempts against 1 + 2 kills explained.
        ("outage attempts", f.outage_attempts.to_string(), "3".into()),
        ("duplicates", f.duplicates.to_string(), "2".into()),
        // #8's first copy (14.0) is more than 0 s but within 5 s of the window (12–13).
        (
            "duplicates near a fault",
            f.near_fault.to_string(),
            "1".into(),
        ),
        // #13's first copy (30.0) is near no fault; a relay logged its claim as lost.
        (
            "duplicates of a lost claim",
            f.lease_lost.to_string(),
            "1".into(),
        ),
        (
            "poison quarantined",
            format!("{} of {}", f.poison_dead, f.poison_committed),
            "1 of 2".into(),
        ),
    ];
    let mut failed = 0;
    for (what, got, want) in expect {
        let ok = got == want;
        failed += u32::from(!ok);
        println!(
            "{} {what}: {got} (expected {want})",
            if ok { "ok  " } else { "FAIL" }
        );
    }
    i32::from(failed > 0)
}

fn main() {
    if std::env::args().any(|a| a == "--check-the-checker") {
        std::process::exit(check_the_checker());
    }
    let args = parse_args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let code = runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            code = run(args) => code,
            _ = tokio::signal::ctrl_c() => 130,
            _ = term.recv() => 143,
        }
    });
    if code >= 128 {
        eprintln!("soak: interrupted; stopping its servers and relays");
    }
    stop_everything();
    std::process::exit(code);
}

#[allow(clippy::too_many_lines)]
async fn run(args: Args) -> i32 {
    let started = Instant::now();
    let stamp = || stamp_at(started);
    let keep = std::env::var_os("SOAK_KEEP").is_some();
    let tmp = tempfile::Builder::new()
        .prefix("outbox-soak-")
        .tempdir()
        .expect("temp dir");
    let dir = tmp.path().to_owned();
    *DIR.lock().expect("lock") = Some(dir.clone());
    // The private PostgreSQL runs as `postgres` and must reach its directory.
    std::fs::set_permissions(
        &dir,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
    )
    .expect("chmod");
    eprintln!(
        "{} soak: seed {}, {} messages at {}/s, {} faults, {} relays, {} producers, store {:?}, sink {:?}; files in {}",
        stamp(),
        args.seed,
        args.messages,
        args.rate,
        args.faults,
        args.relays,
        args.producers,
        args.store,
        args.sink,
        dir.display()
    );

    // Servers.
    let db = Database::start(args.store, &dir).await;
    let broker = Broker::start(args.sink, &dir).await;
    broker.setup().await;
    let route = broker.route();
    let out = Command::new(OUTBOX)
        .args(["migrate", "--database-url", &db.url])
        .output()
        .expect("outbox migrate");
    assert!(
        out.status.success(),
        "outbox migrate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{} servers up, outbox migrated", stamp());

    // The schedule.
    let mut rng = Rng(args.seed);
    let faults = schedule(&args, &mut rng, db.restartable());
    let mut plan = String::new();
    for (at, f) in &faults {
        let _ = writeln!(plan, "  after {at:>9} messages: {f:?}");
    }
    eprintln!("{} fault schedule (seed {}):\n{plan}", stamp(), args.seed);

    // Relays.
    let db_url = db.url.clone();
    let relays = (0..args.relays)
        .map(|i| {
            let (url, name, route) = (db_url.clone(), format!("soak-{i}"), route.clone());
            let mut p = Proc::new(
                name.clone(),
                dir.join(format!("relay-{i}.log")),
                move || relay_command(&url, &route, &name, false),
            );
            p.start();
            tokio::sync::Mutex::new(p)
        })
        .collect();
    let world = Arc::new(World {
        db: tokio::sync::Mutex::new(db),
        broker: tokio::sync::Mutex::new(broker),
        relays,
        happened: Mutex::new(Happened::default()),
    });

    // A watcher restarts relays that exit on their own (each noted).
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (world, watching) = (world.clone(), watching.clone());
        tokio::spawn(async move {
            while watching.load(Ordering::Relaxed) {
                for r in &world.relays {
                    if let Ok(mut r) = r.try_lock()
                        && let Some(status) = r.exited()
                    {
                        let said = r.said();
                        let when = if said.contains("relay started") {
                            "while running"
                        } else {
                            "at start"
                        };
                        let last = said
                            .lines()
                            .rev()
                            .find(|l| !l.trim().is_empty())
                            .unwrap_or("")
                            .chars()
                            .take(200)
                            .collect::<String>();
                        world
                            .happened
                            .lock()
                            .expect("lock")
                            .relay_exits
                            .push(format!("{when} ({status}): {last}"));
                        r.start();
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };

    // Producers and faults.
    let ledger: Ledger = Arc::new(Mutex::new(HashMap::new()));
    let tally = Arc::new(Tally::default());
    let store = AnyStore::connect(&db_url, StoreConfig::default())
        .await
        .expect("store");
    let mut producers = Vec::new();
    let producers_n = args.producers;
    for p in 0..producers_n {
        let share = args.messages / producers_n + u64::from(p < args.messages % producers_n);
        producers.push(tokio::spawn(produce(
            store.clone(),
            (p, producers_n),
            share,
            (args.rate / producers_n).max(1),
            Rng(args.seed ^ (0xABCD_0000 + p)),
            ledger.clone(),
            tally.clone(),
        )));
    }
    let mut injected = Vec::new();
    let fault_runner = {
        let (world, db_url, tally) = (world.clone(), db_url.clone(), tally.clone());
        tokio::spawn(async move {
            for (at, fault) in faults {
                while tally.written.load(Ordering::Relaxed) < at {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                injected.push(tokio::spawn(inject(world.clone(), db_url.clone(), fault)));
            }
            for f in injected {
                f.await.expect("fault");
            }
        })
    };
    // A line every 30 s while the producers write.
    let reporter = {
        let tally = tally.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(30)).await;
                eprintln!(
                    "{} {} messages written",
                    stamp_at(started),
                    tally.written.load(Ordering::Relaxed)
                );
            }
        })
    };
    for p in producers {
        p.await.expect("producer");
    }
    reporter.abort();
    eprintln!("{} producers done", stamp());
    fault_runner.await.expect("faults");
    eprintln!("{} faults done", stamp());
    watching.store(false, Ordering::Relaxed);
    watcher.await.expect("watcher");

    // Drain: wait for the delayed messages to be due, stop the relays gracefully, then
    // drain until nothing is left (exit 0) or only quarantines happened (exit 4).
    let last_due = ledger
        .lock()
        .expect("lock")
        .values()
        .map(|w| w.due_at)
        .fold(0.0, f64::max);
    let wait = last_due + 1.0 - unix_now();
    if wait > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(wait)).await;
    }
    for r in &world.relays {
        r.lock().await.stop(libc::SIGTERM);
    }
    // A topic pause whose resume never got through would hold its messages: lift it.
    let _ = admin(
        &world,
        &db_url,
        &["resume", "--topic", "soak.plain", "--by", "soak"],
    )
    .await;
    let mut drains = 0;
    let mut settle_by: Option<Instant> = None;
    let drain_deadline = Instant::now() + Duration::from_secs(600);
    loop {
        drains += 1;
        let status =
            tokio::process::Command::from(relay_command(&db_url, &route, "soak-drain", true))
                .stderr(
                    std::fs::File::create(dir.join(format!("drain-{drains}.log"))).expect("log"),
                )
                .status()
                .await
                .expect("outbox relay --drain-wait-leases");
        if !matches!(status.code(), Some(0 | 4)) && Instant::now() <= drain_deadline {
            eprintln!("{} drain {drains}: {status}, again", stamp());
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        // A drain ends when nothing is due; rows a relay rescheduled just before it
        // stopped (a publish refused while the broker was down comes back after the
        // breaker's next probe, up to 2 s later) are pending but not due yet, and the
        // drain leaves them, as it says on exit. Drain again until none is left, for a
        // bounded time: rows that stay pending past it are what the checker reports.
        let left = match store.counts().await {
            Ok(c) => c.pending + c.claimed,
            Err(e) => {
                eprintln!(
                    "{} drain {drains}: {status}; counting the rows left failed: {e}",
                    stamp()
                );
                1
            }
        };
        let settle_deadline = *settle_by.get_or_insert(Instant::now() + SETTLE_AFTER_DRAIN);
        if left == 0 || Instant::now() > settle_deadline || Instant::now() > drain_deadline {
            eprintln!(
                "{} drain {drains}: {status}; {left} rows pending or claimed",
                stamp()
            );
            break;
        }
        eprintln!(
            "{} drain {drains}: {status}, but {left} rows pending or claimed (not due yet): again",
            stamp()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    // Check.
    let deliveries = world.broker.lock().await.read().await;
    let rows = read_rows(&*world.db.lock().await).await;
    let live = live_rows_detail(&*world.db.lock().await).await;
    let ledger = ledger.lock().expect("lock").clone();
    // The servers stop as an operator would stop them (PostgreSQL: fast shutdown).
    {
        let mut db = world.db.lock().await;
        let signal = if db.kind == StoreKind::Postgres {
            libc::SIGINT
        } else {
            libc::SIGTERM
        };
        if let Some(server) = db.server.as_mut() {
            server.stop(signal);
        }
        world.broker.lock().await.stop();
    }
    let mut happened = std::mem::take(&mut *world.happened.lock().expect("lock"));
    happened.lost_claims = lost_claims_in_logs(&dir);
    let f = check(&ledger, &deliveries, &rows, &happened);

    eprintln!(
        "\n{} seed {}; store {:?}; {} messages written ({} committed, {} rolled back, \
         {} with an unknown commit outcome); {} producer errors",
        stamp(),
        args.seed,
        args.store,
        ledger.len(),
        f.committed,
        f.rolled_back,
        f.uncertain,
        tally.errors.load(Ordering::Relaxed),
    );
    eprintln!(
        "faults: {} relay kills, {} database restarts, {} broker stops, {} topic pauses, {} purges, \
         {} dead-letter replays; relays that exited on their own: {}; admin commands refused: {}; drains: {drains}",
        happened.kills,
        happened.db_restarts,
        happened.broker_stops,
        happened.pauses,
        happened.purges,
        happened.replays,
        happened.relay_exits.len(),
        happened.cli_failures.len(),
    );
    // Grouped by what the relay said last (a relay started while the database is down
    // cannot open the store and exits 1; the watcher starts it again, as a supervisor would).
    let mut exits: BTreeMap<String, u64> = BTreeMap::new();
    for e in &happened.relay_exits {
        let said = e.split(" at ").next().unwrap_or(e);
        *exits.entry(said.to_owned()).or_default() += 1;
    }
    for (said, n) in &exits {
        eprintln!("  {n} × exited: {said}");
    }
    for e in happened.cli_failures.iter().take(5) {
        eprintln!("  refused: {e}");
    }
    eprintln!(
        "broker: {} deliveries of {} message ids; store: {} rows at the end; poison quarantined \
         {} of {}; header/body id mismatches {}",
        deliveries.len(),
        f.distinct,
        rows.len(),
        f.poison_dead,
        f.poison_committed,
        f.mismatched,
    );
    for id in f.lost.iter().take(10) {
        eprintln!("  lost: {id} (row: {:?})", rows.get(id));
    }
    if !f.lost.is_empty() {
        for l in &live {
            eprintln!("  live at the end: {l}");
        }
    }
    for id in f.rolled_back_delivered.iter().take(10) {
        eprintln!("  rolled back but delivered: {id}");
    }
    for id in f.dead_not_poison.iter().take(10) {
        eprintln!("  quarantined though not poison: {id}");
    }
    for v in &f.violation_examples {
        eprintln!("  order: {v}");
    }
    eprintln!(
        "wall time {:.1}s; files in {}",
        started.elapsed().as_secs_f64(),
        dir.display()
    );
    if keep {
        let _ = tmp.keep();
    }
    let windows = if args.sink == SinkKind::Nats {
        format!(
            "{} within {WINDOW_S} s of a relay kill, database restart or broker stop, \
             {} of a claim a relay lost to its lease, {} other",
            f.near_fault,
            f.lease_lost,
            f.duplicates - f.near_fault - f.lease_lost
        )
    } else {
        format!(
            "{} of a claim a relay lost to its lease; the queue keeps no publish time to place the rest",
            f.lease_lost
        )
    };
    println!(
        "lost {}, rolled-back delivered {}, order violations {}, outage attempts {}, \
         duplicates {} ({windows}; still pending {})",
        f.lost.len(),
        f.rolled_back_delivered.len(),
        f.order_violations,
        f.outage_attempts,
        f.duplicates,
        f.still_pending,
    );
    let ok = f.lost.is_empty()
        && f.rolled_back_delivered.is_empty()
        && f.order_violations == 0
        && f.outage_attempts == 0
        && f.poison_dead == f.poison_committed
        && f.mismatched == 0;
    i32::from(!ok)
}

/// What the checker found.
#[derive(Default)]
struct Findings {
    committed: u64,
    rolled_back: u64,
    uncertain: u64,
    /// Message ids on the broker.
    distinct: usize,
    lost: Vec<String>,
    still_pending: u64,
    rolled_back_delivered: Vec<String>,
    dead_not_poison: Vec<String>,
    poison_committed: u64,
    poison_dead: u64,
    mismatched: u64,
    duplicates: u64,
    near_fault: u64,
    /// Duplicates (not near a fault) of a message whose claim a relay lost to its lease.
    lease_lost: u64,
    order_violations: u64,
    violation_examples: Vec<String>,
    outage_attempts: i64,
}

/// Compares what the producers wrote with the broker's deliveries and the store's rows.
fn check(
    ledger: &HashMap<Uuid, Written>,
    deliveries: &[Delivery],
    rows: &HashMap<String, (i64, i64)>,
    happened: &Happened,
) -> Findings {
    let mut f = Findings::default();

    let mut first_seen: HashMap<&str, usize> = HashMap::new();
    let mut copies: HashMap<&str, u64> = HashMap::new();
    for (i, d) in deliveries.iter().enumerate() {
        if d.id != d.body_id {
            f.mismatched += 1;
        }
        let n = copies.entry(d.id.as_str()).or_default();
        *n += 1;
        if *n == 1 {
            first_seen.insert(d.id.as_str(), i);
        } else {
            f.duplicates += 1;
            if let Some(t) = deliveries[first_seen[d.id.as_str()]].at
                && happened
                    .windows
                    .iter()
                    .any(|(s, e)| t >= s - WINDOW_S && t <= e + WINDOW_S)
            {
                f.near_fault += 1;
            } else if happened.lost_claims.contains(d.id.as_str()) {
                f.lease_lost += 1;
            }
        }
    }
    let mut extra_attempts = 0;
    let attempts_explained = 1 + happened.kills as i64 + happened.db_restarts as i64;
    let mut by_key: BTreeMap<&str, Vec<(usize, u64)>> = BTreeMap::new();
    for (id, w) in ledger {
        let ids = id.to_string();
        let delivered = copies.contains_key(ids.as_str());
        let row = rows.get(&ids);
        match w.fate {
            Fate::Committed => f.committed += 1,
            Fate::Uncertain => f.uncertain += 1,
            Fate::RolledBack => f.rolled_back += 1,
        }
        if w.fate == Fate::RolledBack {
            if delivered {
                f.rolled_back_delivered.push(ids);
            }
            continue;
        }
        if let (Some((key, pos)), Some(&i)) = (&w.ordered, first_seen.get(ids.as_str())) {
            by_key.entry(key.as_str()).or_default().push((i, *pos));
        }
        // Attempts of live and dispatched rows (a dead one is counted whole below).
        if let Some(&(state, attempts)) = row
            && state != 3
            && !w.poison
        {
            extra_attempts += (attempts - attempts_explained).max(0);
        }
        if w.poison {
            if w.fate == Fate::Committed {
                f.poison_committed += 1;
                if matches!(row, Some(&(3, _))) {
                    f.poison_dead += 1;
                }
            }
            continue;
        }
        match row {
            Some(&(3, _)) => f.dead_not_poison.push(ids),
            Some(&(0 | 1, _)) if !delivered => {
                f.still_pending += 1;
                f.lost.push(ids);
            }
            None | Some(_) if !delivered && w.fate == Fate::Committed => f.lost.push(ids),
            _ => {}
        }
    }
    for (key, mut seen) in by_key {
        seen.sort_unstable();
        let mut highest = 0;
        for (_, pos) in seen {
            if pos < highest {
                f.order_violations += 1;
                if f.violation_examples.len() < 5 {
                    f.violation_examples
                        .push(format!("{key}: #{pos} after #{highest}"));
                }
            }
            highest = highest.max(pos);
        }
    }
    f.distinct = copies.len();
    f.outage_attempts = f.dead_not_poison.len() as i64 + extra_attempts;
    f
}
