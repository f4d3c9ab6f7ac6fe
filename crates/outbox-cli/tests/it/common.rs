//! What the binary's tests share: the services' URLs, the `outbox` command with a clean
//! environment, names of their own, and running a command that must succeed.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub(crate) const PG: &str = "postgres://postgres@127.0.0.1:5432/test";
pub(crate) const MYSQL: &str = "mysql://root@127.0.0.1:3306/test";
pub(crate) const NATS: &str = "nats://127.0.0.1:4222";

/// The binary under test, with none of the caller's `OUTBOX_DATABASE_URL` / `OUTBOX_SINK`
/// and warnings only.
pub(crate) fn outbox() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_outbox"));
    c.env_remove("OUTBOX_DATABASE_URL")
        .env_remove("OUTBOX_SINK")
        .env("OUTBOX_LOG", "warn");
    c
}

/// `{prefix}_` and 10 random hex digits: a schema, table prefix or stream of one test.
pub(crate) fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

/// Runs `cmd` to its end.
pub(crate) fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap()
}

/// Runs `cmd`, which must succeed; its stdout.
pub(crate) fn run_ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({:?}): {}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `relay --drain` (`cmd`) that quarantines messages on purpose: it must exit 4
/// (every publish settled, some messages quarantined); its stdout.
pub(crate) fn run_quarantining(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert_eq!(
        out.status.code(),
        Some(4),
        "{cmd:?}: expected exit 4 (quarantined): {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A free loopback port.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The machine's NATS, as a JetStream context; fails loudly with how to start it.
pub(crate) async fn jetstream() -> async_nats::jetstream::Context {
    let client = async_nats::connect(NATS).await.expect(
        "NATS with JetStream must listen on 127.0.0.1:4222 (start: start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server)",
    );
    async_nats::jetstream::new(client)
}

/// Polls `f` every 100 ms until it returns a value; panics after `timeout`, naming `what`.
pub(crate) fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A child process killed when dropped, so a failed assertion leaves no relay behind.
pub(crate) struct Killed(pub(crate) std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Killed {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for Killed {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}
