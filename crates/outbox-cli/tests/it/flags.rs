//! The flags a person guesses: retention as a duration (`purge --older-than 7d`, the
//! earlier `--older-than-s` and `retention-s` still read), the `--yes` rule of every purge
//! (more than 1,000 rows), `--by` defaulting to the user running the command, and usage
//! lines that do not show an option given by its environment variable as required.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::{PG, outbox, run, run_ok, unique};
use std::io::Write;
use std::process::{Command, Stdio};

/// A migrated SQLite outbox in a directory of its own.
struct Sqlite {
    dir: tempfile::TempDir,
    url: String,
}

impl Sqlite {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("flags.db").display());
        let db = Sqlite { dir, url };
        run_ok(db.cmd().arg("migrate"));
        db
    }

    /// `outbox` on this outbox, run in its directory (no outbox.toml but the test's), with
    /// no terminal.
    fn cmd(&self) -> Command {
        let mut c = outbox();
        c.current_dir(self.dir.path())
            .args(["--database-url", &self.url])
            .stdin(Stdio::null());
        c
    }

    /// Runs `sql` with the `sqlite3` shell.
    fn exec(&self, sql: &str) {
        let path = self.url.trim_start_matches("sqlite://");
        let mut sqlite = Command::new("sqlite3")
            .arg(path)
            .stdin(Stdio::piped())
            .spawn()
            .expect("sqlite3 must be installed");
        sqlite
            .stdin
            .take()
            .unwrap()
            .write_all(sql.as_bytes())
            .unwrap();
        assert!(sqlite.wait().unwrap().success());
    }

    /// `n` dispatched rows, dispatched `days_ago` days ago.
    fn dispatched(&self, n: usize, days_ago: i64) {
        let sql = (0..n)
            .map(|_| {
                format!(
                    "INSERT INTO outbox_messages (message_id, topic, payload, status, dispatched_at) \
                     VALUES ('{}', 'flags.v1', x'00', 2, \
                     {NOW_MS} - {days_ago} * 86400000);",
                    uuid::Uuid::new_v4()
                )
            })
            .collect::<String>();
        self.exec(&format!("BEGIN;{sql}COMMIT;"));
    }

    /// `n` inbox rows of consumer `c`, received `days_ago` days ago.
    fn inbox(&self, n: usize, days_ago: i64) {
        let sql = (0..n)
            .map(|_| {
                format!(
                    "INSERT INTO outbox_inbox (consumer, message_id, received_at) \
                     VALUES ('c', '{}', {NOW_MS} - {days_ago} * 86400000);",
                    uuid::Uuid::new_v4()
                )
            })
            .collect::<String>();
        self.exec(&format!("BEGIN;{sql}COMMIT;"));
    }

    fn count(&self, sql: &str) -> u64 {
        let path = self.url.trim_start_matches("sqlite://");
        let out = Command::new("sqlite3").arg(path).arg(sql).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    fn dispatched_left(&self) -> u64 {
        self.count("SELECT count(*) FROM outbox_messages WHERE status = 2")
    }

    fn inbox_left(&self) -> u64 {
        self.count("SELECT count(*) FROM outbox_inbox")
    }
}

/// Now in ms, as the SQLite store writes its times.
const NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out.trim()).unwrap()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `purge --older-than` takes a duration; `--older-than-s` (seconds) still works, and so do
/// `OUTBOX_RETENTION_S` and `retention-s` in outbox.toml; the new names come first.
#[test]
fn purge_retention_is_a_duration_and_the_seconds_spelling_still_works() {
    let db = Sqlite::new();
    db.dispatched(3, 10);
    db.dispatched(2, 3);
    db.dispatched(1, 0);

    // 30 days keeps everything; 7d deletes the 10-day-old rows.
    let out = run_ok(db.cmd().args(["purge", "--older-than", "30d"]));
    assert_eq!(json(&out)["deleted"], 0, "{out}");
    let out = run_ok(db.cmd().args(["purge", "--older-than", "7d"]));
    assert_eq!(json(&out)["deleted"], 3, "{out}");
    // The seconds spelling: 2 days.
    let out = run_ok(db.cmd().args(["purge", "--older-than-s", "172800"]));
    assert_eq!(json(&out)["deleted"], 2, "{out}");
    assert_eq!(db.dispatched_left(), 1);

    // The variables: OUTBOX_RETENTION (a duration), OUTBOX_RETENTION_S (seconds).
    db.dispatched(2, 3);
    let out = run_ok(db.cmd().arg("purge").env("OUTBOX_RETENTION_S", "345600"));
    assert_eq!(json(&out)["deleted"], 0, "4 days keeps them: {out}");
    let out = run_ok(
        db.cmd()
            .arg("purge")
            .env("OUTBOX_RETENTION_S", "345600")
            .env("OUTBOX_RETENTION", "2d"),
    );
    assert_eq!(
        json(&out)["deleted"],
        2,
        "the new variable comes first: {out}"
    );
    // The flag comes before both.
    db.dispatched(2, 3);
    let out = run_ok(
        db.cmd()
            .args(["purge", "--older-than", "5d"])
            .env("OUTBOX_RETENTION", "2d"),
    );
    assert_eq!(json(&out)["deleted"], 0, "{out}");

    // outbox.toml: the earlier key, in seconds, and the new one.
    let toml = db.dir.path().join("outbox.toml");
    std::fs::write(&toml, "retention-s = 172800\n").unwrap();
    let out = run_ok(db.cmd().arg("purge"));
    assert_eq!(json(&out)["deleted"], 2, "retention-s is still read: {out}");
    db.dispatched(2, 3);
    std::fs::write(&toml, "retention = \"4d\"\n").unwrap();
    let out = run_ok(db.cmd().arg("purge"));
    assert_eq!(json(&out)["deleted"], 0, "{out}");
    std::fs::write(&toml, "retention = \"36h\"\n").unwrap();
    let out = run_ok(db.cmd().arg("purge"));
    assert_eq!(json(&out)["deleted"], 2, "{out}");
    // Without any: 7 days.
    std::fs::remove_file(&toml).unwrap();
    db.dispatched(1, 8);
    let out = run_ok(db.cmd().arg("purge"));
    assert_eq!(json(&out)["deleted"], 1, "{out}");
    assert_eq!(db.dispatched_left(), 1, "the row dispatched now stays");

    // Not a duration: a usage error naming the flag.
    let bad = run(db.cmd().args(["purge", "--older-than", "7"]));
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("--older-than"), "{}", stderr(&bad));
}

/// A purge of more than 1,000 dispatched rows, like every other destructive command, needs
/// `--yes` (a prompt on a terminal): without a terminal it is refused and deletes nothing.
#[test]
fn a_purge_of_more_than_a_thousand_rows_needs_yes() {
    let db = Sqlite::new();
    db.dispatched(1_001, 10);
    db.dispatched(5, 0);

    for args in [
        &["purge", "--older-than", "0s"][..],
        &["purge", "--older-than-s", "0"],
        &["purge"],
    ] {
        let refused = run(db.cmd().args(args));
        assert_eq!(refused.status.code(), Some(1), "{args:?}");
        let err = stderr(&refused);
        assert!(
            err.contains("dispatched rows are older than")
                && err.contains("--yes was not given")
                && err.contains("more than 1,000 rows"),
            "{args:?}: {err}"
        );
        assert!(refused.stdout.is_empty(), "{args:?}");
        assert_eq!(db.dispatched_left(), 1_006, "{args:?}: nothing deleted");
    }
    let err = stderr(&run(db.cmd().arg("purge")));
    assert!(
        err.contains("1,001 dispatched rows are older than 7days"),
        "{err}"
    );

    // 1,000 or fewer need nothing.
    let out = run_ok(db.cmd().args(["purge", "--older-than", "11d"]));
    assert_eq!(json(&out)["deleted"], 0, "{out}");
    let out = run_ok(db.cmd().args(["purge", "--yes", "--batch-size", "300"]));
    assert_eq!(json(&out)["deleted"], 1_001, "{out}");
    assert_eq!(db.dispatched_left(), 5);
    let out = run_ok(db.cmd().args(["purge", "--older-than", "0s"]));
    assert_eq!(json(&out)["deleted"], 5, "five rows need no --yes: {out}");
}

/// `inbox purge` follows the same rule.
#[test]
fn an_inbox_purge_of_more_than_a_thousand_rows_needs_yes() {
    let db = Sqlite::new();
    db.inbox(1_001, 10);
    let refused = run(db.cmd().args(["inbox", "purge", "--older-than", "7d"]));
    assert_eq!(refused.status.code(), Some(1));
    let err = stderr(&refused);
    assert!(
        err.contains("1,001 inbox rows are older than 7days and --yes was not given"),
        "{err}"
    );
    assert_eq!(db.inbox_left(), 1_001);
    let out = run_ok(
        db.cmd()
            .args(["inbox", "purge", "--older-than", "7d", "--yes"]),
    );
    assert_eq!(json(&out)["deleted"], 1_001, "{out}");
    db.inbox(10, 10);
    let out = run_ok(db.cmd().args(["inbox", "purge", "--older-than", "7d"]));
    assert_eq!(json(&out)["deleted"], 10, "{out}");
}

/// The count before a purge is the store's: on PostgreSQL too.
#[test]
fn a_purge_on_postgres_counts_before_it_deletes() {
    let schema = unique("flags");
    let cmd = || {
        let mut c = outbox();
        c.args(["--database-url", PG, "--schema", &schema])
            .stdin(Stdio::null());
        c
    };
    run_ok(cmd().arg("migrate"));
    let psql = |sql: &str| {
        let out = Command::new("psql")
            .args([PG, "-v", "ON_ERROR_STOP=1", "-qAtc", sql])
            .output()
            .expect("psql must be installed");
        assert!(out.status.success(), "{}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    psql(&format!(
        "INSERT INTO {schema}.messages (message_id, topic, payload, status, dispatched_at)
         SELECT gen_random_uuid(), 'flags.v1', '\\x00', 2, now() - interval '10 days'
         FROM generate_series(1, 1001)"
    ));
    let refused = run(cmd().args(["purge", "--older-than", "7d"]));
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr(&refused).contains("1,001 dispatched rows are older than 7days"),
        "{}",
        stderr(&refused)
    );
    let out = run_ok(cmd().args(["purge", "--older-than", "7d", "--yes"]));
    assert_eq!(json(&out)["deleted"], 1_001, "{out}");
    psql(&format!(
        "INSERT INTO {schema}.inbox (consumer, message_id, received_at)
         SELECT 'c', gen_random_uuid(), now() - interval '10 days' FROM generate_series(1, 1001)"
    ));
    let refused = run(cmd().args(["inbox", "purge", "--older-than", "7d"]));
    assert!(
        stderr(&refused).contains("1,001 inbox rows are older than 7days"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(
        psql(&format!("SELECT count(*) FROM {schema}.inbox")),
        "1001"
    );
    psql(&format!("DROP SCHEMA {schema} CASCADE"));
}

/// Every audited command records the user running it when `--by` is not given: $USER,
/// else $LOGNAME, else the name of the user id; and says so in its help.
#[test]
fn by_defaults_to_the_user_running_the_command() {
    let db = Sqlite::new();
    // Two dead rows to replay and discard.
    db.exec(
        &(0..2)
            .map(|_| {
                format!(
                    "INSERT INTO outbox_messages (message_id, topic, payload, status, last_error) \
                     VALUES ('{}', 'flags.v1', x'00', 3, 'permanent: test');",
                    uuid::Uuid::new_v4()
                )
            })
            .collect::<String>(),
    );
    run_ok(
        db.cmd()
            .args(["pause", "--reason", "deploy"])
            .env("USER", "alice"),
    );
    run_ok(
        db.cmd()
            .arg("resume")
            .env_remove("USER")
            .env("LOGNAME", "bob"),
    );
    run_ok(
        db.cmd()
            .args(["replay", "1", "--reason", "fixed"])
            .env("USER", "carol"),
    );
    run_ok(
        db.cmd()
            .args(["dead", "discard", "2", "--reason", "junk"])
            .env("USER", "dave"),
    );
    // Neither variable: the user database's name for the uid, as `id -un` gives it.
    let id = Command::new("id").arg("-un").output().unwrap();
    let me = String::from_utf8_lossy(&id.stdout).trim().to_owned();
    run_ok(
        db.cmd()
            .args(["pause", "--reason", "again", "--topic", "flags.>"])
            .env_remove("USER")
            .env_remove("LOGNAME"),
    );
    // An explicit --by still wins.
    run_ok(
        db.cmd()
            .args(["resume", "--topic", "flags.>", "--by", "erin"])
            .env("USER", "alice"),
    );
    let audit: Vec<serde_json::Value> = run_ok(db.cmd().args(["replays", "list", "--json"]))
        .lines()
        .map(json)
        .collect();
    let mut by: Vec<(String, String)> = audit
        .iter()
        .map(|r| {
            (
                r["action"].as_str().unwrap().to_owned(),
                r["by"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    by.sort();
    let mut expected = vec![
        ("pause".to_owned(), "alice".to_owned()),
        ("resume".to_owned(), "bob".to_owned()),
        ("replay".to_owned(), "carol".to_owned()),
        ("discard".to_owned(), "dave".to_owned()),
        ("pause".to_owned(), me.clone()),
        ("resume".to_owned(), "erin".to_owned()),
    ];
    expected.sort();
    assert_eq!(by, expected, "{audit:?}");
    assert_ne!(me, "unknown");

    for command in [
        &["pause"][..],
        &["resume"],
        &["replay"],
        &["dead", "discard"],
        &["purge"],
    ] {
        let help = run_ok(db.cmd().args(command).arg("--help").env("USER", "alice"));
        assert!(
            help.contains("by default the user running the command")
                && help.contains("[default: alice]"),
            "{command:?}: {help}"
        );
    }
}

/// An option given by its environment variable is not shown as required in a usage line;
/// given on the command line it is a flag like any other.
#[test]
fn the_usage_line_does_not_require_what_the_environment_gave() {
    let db = Sqlite::new();
    for command in [&["replay", "1"][..], &["dead", "discard", "1"]] {
        let out = run(outbox()
            .args(command)
            .env("OUTBOX_DATABASE_URL", &db.url)
            .env("OUTBOX_SCHEMA", "outbox"));
        assert_eq!(out.status.code(), Some(2));
        let err = stderr(&out);
        let usage = err
            .lines()
            .find(|l| l.starts_with("Usage:"))
            .unwrap_or_else(|| panic!("{err}"));
        assert!(
            !usage.contains("--database-url") && !usage.contains("--schema"),
            "{usage}"
        );
        assert!(usage.contains("[OPTIONS]"), "{usage}");
        assert!(err.contains("--reason <REASON>"), "{err}");
    }
    // A missing database names both the flag and its variable.
    let out = run(outbox()
        .current_dir(db.dir.path())
        .arg("status")
        .env("OUTBOX_DATABASE_URL", "sqlite://nowhere.db"));
    let err = stderr(&out);
    assert!(
        err.contains("--database-url") && err.contains("OUTBOX_DATABASE_URL"),
        "{err}"
    );
}

/// `/api/messages` shows a dispatched row's times as they happened: its `available_at`
/// (where its last lease ended, after it was dispatched) is null.
#[test]
fn the_api_shows_no_lease_end_on_a_dispatched_row() {
    use crate::dashboard::{Api, Db, OPERATOR, serve};
    let db = Db::new(None);
    run_ok(db.cmd().arg("migrate"));
    let sent = db.enqueue("flags.v1", Some("k-1"), "{}");
    db.enqueue("flags.v1", Some("k-1"), "{}");
    // Delivered under a lease of a minute: the rows' available_at is then a minute after
    // their dispatched_at.
    run_ok(db.cmd().args([
        "relay",
        "--sink",
        "stdout",
        "--drain",
        "--lease-ms",
        "60000",
    ]));
    let later = db.enqueue("flags.v2", Some("k-2"), "{}");
    let server = serve(&db);
    let api = Api { port: server.port };
    let rows = |q: &str| api.get(&format!("/api/messages?q={q}"), Some(OPERATOR)).1["rows"].clone();
    let dispatched = &rows(sent["message_id"].as_str().unwrap())[0];
    assert_eq!(dispatched["status"], "dispatched", "{dispatched}");
    assert!(dispatched["dispatched_at"].is_string(), "{dispatched}");
    assert!(dispatched["available_at"].is_null(), "{dispatched}");
    let pending = &rows(later["message_id"].as_str().unwrap())[0];
    assert_eq!(pending["status"], "pending", "{pending}");
    assert!(pending["available_at"].is_string(), "{pending}");
    // By key: every dispatched row of the key the same way.
    for row in rows("k-1").as_array().unwrap() {
        if row["status"] == "dispatched" {
            assert!(row["available_at"].is_null(), "{row}");
        }
    }
}

/// A sink URL or route the relay cannot read as written (an unknown scheme, a malformed
/// pattern) is a configuration error: exit 2, as a bad flag, before anything is claimed.
/// `migrate` names a SQLite outbox's table prefix, not a schema.
#[test]
fn a_sink_url_the_relay_cannot_read_is_a_usage_error() {
    let db = Sqlite::new();
    for args in [
        &["relay", "--sink", "bogus://x", "--drain"][..],
        &["relay", "--route", "a.>=bogus://x", "--drain"],
        &["relay", "--route", "a.>.b=stdout", "--drain"],
    ] {
        let out = run(db.cmd().args(args));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("error:"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    // A sink that cannot be opened (a file in a directory that does not exist) is not a
    // usage error: exit 1.
    let out = run(db.cmd().args([
        "relay",
        "--sink",
        "file:/nonexistent/dir/out.jsonl",
        "--drain",
    ]));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));

    let out = run(db.cmd().arg("migrate"));
    assert!(
        stderr(&out).contains("table prefix \"outbox\""),
        "{}",
        stderr(&out)
    );
}
