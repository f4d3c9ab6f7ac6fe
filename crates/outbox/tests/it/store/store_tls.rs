//! The PostgreSQL and MySQL stores over TLS, against private servers this module starts on
//! loopback with the throwaway CA of `sink/tls.rs`: a PostgreSQL 15 cluster that takes only TLS
//! (`hostssl` lines, a `hostnossl … reject`) and a MariaDB whose users `REQUIRE SSL` (or
//! a certificate subject), each with a password user and a user authenticated by its
//! client certificate. Each checks that the store migrates, enqueues and claims over a
//! verified connection configured by the URL alone, and the clear error at connect for an
//! untrusted server certificate, a name the certificate does not carry and a plain-text
//! connection.

#![allow(clippy::unwrap_used)]

use crate::common::free_port;
use crate::sink::tls::{Pki, Server};
use outbox::store::ClaimRequest;
use outbox::store::prelude::*;
use outbox::{AnyStore, Message, StoreConfig};
use sqlx::ConnectOptions;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PASSWORD: &str = "s3cret-store-TLS";
/// The user the client certificate authenticates: its common name.
const CERT_USER: &str = "outbox-relay";

/// Connects through `AnyStore` (as the CLI opens stores), migrates, enqueues one message
/// and claims it back.
async fn round_trip(url: &str) -> AnyStore {
    let store = AnyStore::connect(url, StoreConfig::default())
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    store.migrate().await.unwrap();
    let topic = format!("tls.{}", crate::common::unique());
    store
        .enqueue_alone(&Message::new(topic.as_str(), b"over TLS".to_vec()))
        .await
        .unwrap();
    let claim = store
        .claim(&ClaimRequest {
            relay_id: "store-tls".into(),
            batch_size: 10,
            lease: Duration::from_secs(30),
            skip_topics: Vec::new(),
            ordering: Default::default(),
        })
        .await
        .unwrap();
    let mine: Vec<_> = claim.messages.iter().filter(|m| m.topic == topic).collect();
    assert_eq!(mine.len(), 1, "{:?}", claim.messages);
    assert_eq!(&mine[0].payload[..], b"over TLS");
    store
}

/// The error `AnyStore::connect` gave, as text; panics when it connected.
async fn connect_error(url: &str) -> String {
    match AnyStore::connect(url, StoreConfig::default()).await {
        Ok(_) => panic!("{url} connected"),
        Err(e) => {
            let text = e.to_string();
            eprintln!("{}\n  -> {text}", outbox::redact::redact_url(url));
            text
        }
    }
}

/// The uid and gid of a system user.
fn ids_of(user: &str) -> (u32, u32) {
    let id = |flag: &str| {
        let out = Command::new("id").args([flag, user]).output().unwrap();
        assert!(out.status.success(), "no user {user} on this machine");
        String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    (id("-u"), id("-g"))
}

/// Copies `file` of the PKI into `dir`, owned by `owner` with `mode` (servers refuse a
/// private key others can read).
fn install(pki: &Pki, file: &str, dir: &Path, owner: (u32, u32), mode: u32) {
    let to = dir.join(file);
    std::fs::copy(pki.path(file), &to).unwrap();
    std::os::unix::fs::chown(&to, Some(owner.0), Some(owner.1)).unwrap();
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode)).unwrap();
}

// ---------------------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------------------

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// A private PostgreSQL cluster, run as the `postgres` user (PostgreSQL refuses root),
/// listening on 127.0.0.1 and 127.0.0.2 with TLS only; shut down (fast) when dropped.
struct PgCluster {
    server: Server,
    port: u16,
    // Dropped after the server: the data directory and the socket.
    dir: tempfile::TempDir,
}

impl PgCluster {
    async fn start(pki: &Pki) -> Self {
        let started = Instant::now();
        let owner = ids_of("postgres");
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::os::unix::fs::chown(d, Some(owner.0), Some(owner.1)).unwrap();
        let data = d.join("data");
        let out = Command::new(format!("{PG_BIN}/initdb"))
            .uid(owner.0)
            .gid(owner.1)
            .current_dir(d)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale"])
            .args(["--no-sync", "--no-instructions", "-D"])
            .arg(&data)
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run {PG_BIN}/initdb ({e}); install Debian's postgresql-15")
            });
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for (file, mode) in [
            ("server.pem", 0o644),
            ("server.key", 0o600),
            ("ca.pem", 0o644),
        ] {
            install(pki, file, &data, owner, mode);
        }
        // The socket (trust, for the setup below) and TLS on TCP; plain TCP is refused.
        std::fs::write(
            data.join("pg_hba.conf"),
            format!(
                "local     all  postgres          trust\n\
                 hostssl   all  \"{CERT_USER}\"  127.0.0.1/32  cert\n\
                 hostssl   all  app               127.0.0.0/8   scram-sha-256\n\
                 hostnossl all  all               0.0.0.0/0     reject\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let mut cmd = Command::new(format!("{PG_BIN}/postgres"));
        cmd.uid(owner.0)
            .gid(owner.1)
            .current_dir(d)
            .arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(d)
            .args(["-p", &port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1,127.0.0.2"])
            .args(["-c", "ssl=on"])
            .args(["-c", "ssl_cert_file=server.pem"])
            .args(["-c", "ssl_key_file=server.key"])
            .args(["-c", "ssl_ca_file=ca.pem"])
            .args(["-c", "fsync=off", "-c", "logging_collector=off"]);
        let mut server = Server::spawn("postgres", cmd, d.join("postgres.log"));
        server.wait_port(port).await;
        let cluster = PgCluster { server, port, dir };
        // Accepting TCP is not accepting sessions yet ("the database system is starting
        // up"): wait for the socket to let the setup in.
        let slot = std::sync::Mutex::new(None);
        let (c, s) = (&cluster, &slot);
        crate::common::wait_until(
            "private postgres to accept sessions",
            Duration::from_secs(20).saturating_sub(started.elapsed()),
            || async move {
                match c.admin().connect().await {
                    Ok(conn) => {
                        *s.lock().unwrap() = Some(conn);
                        Ok(())
                    }
                    Err(e) => Err(format!("{e}; log:\n{}", c.server.log())),
                }
            },
        )
        .await;
        let mut admin = slot.into_inner().unwrap().unwrap();
        for sql in [
            format!("CREATE ROLE app LOGIN PASSWORD '{PASSWORD}'"),
            "CREATE DATABASE app OWNER app".to_owned(),
            format!("CREATE ROLE \"{CERT_USER}\" LOGIN"),
            format!("CREATE DATABASE relay OWNER \"{CERT_USER}\""),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut admin)
                .await
                .unwrap();
        }
        eprintln!("private postgres ready in {:?}", started.elapsed());
        cluster
    }

    /// The superuser over the cluster's socket.
    fn admin(&self) -> sqlx::postgres::PgConnectOptions {
        sqlx::postgres::PgConnectOptions::new_without_pgpass()
            .socket(self.dir.path())
            .port(self.port)
            .username("postgres")
            .database("postgres")
            .ssl_mode(sqlx::postgres::PgSslMode::Disable)
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        // Fast shutdown: sessions end, shared memory is released.
        self.server.stop("INT");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_over_tls() {
    let started = Instant::now();
    let pki = Pki::new();
    let mut pg = PgCluster::start(&pki).await;
    let port = pg.port;
    let ca = pki.show("ca.pem");
    let app =
        |host: &str, params: &str| format!("postgres://app:{PASSWORD}@{host}:{port}/app?{params}");

    // verify-full: the chain up to the CA of sslrootcert, and the host name.
    let store = round_trip(&app(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await;
    let AnyStore::Postgres(pg_store) = &store else {
        panic!("not the PostgreSQL store")
    };
    let (ssl, version): (bool, String) =
        sqlx::query_as("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(pg_store.pool())
            .await
            .unwrap();
    assert!(ssl && version.starts_with("TLS"), "{ssl} {version}");
    drop(store);

    // A client certificate instead of a password (`cert` in pg_hba.conf: its common name
    // is the user), to the address the certificate names.
    let relay = format!(
        "postgres://{CERT_USER}@127.0.0.1:{port}/relay?sslmode=verify-full&sslrootcert={ca}\
         &sslcert={}&sslkey={}",
        pki.show("client.pem"),
        pki.show("client.key")
    );
    let store = round_trip(&relay).await;
    let AnyStore::Postgres(pg_store) = &store else {
        panic!("not the PostgreSQL store")
    };
    let user: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(pg_store.pool())
        .await
        .unwrap();
    assert_eq!(user, CERT_USER);
    drop(store);

    // verify-ca checks the chain but not the name: 127.0.0.2 is not in the certificate.
    round_trip(&app(
        "127.0.0.2",
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    ))
    .await;
    let e = connect_error(&app(
        "127.0.0.2",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await;
    assert!(e.contains("certificate not valid for name"), "{e}");

    // A CA that did not sign the server's certificate.
    let e = connect_error(&app(
        "localhost",
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            pki.show("other-ca.pem")
        ),
    ))
    .await;
    assert!(e.contains("TLS") && e.contains("certificate"), "{e}");
    // The system's roots alone do not know the test CA either.
    let e = connect_error(&app("localhost", "sslmode=verify-full")).await;
    assert!(e.contains("certificate"), "{e}");

    // Plain text: the server refuses it (hostnossl … reject).
    let e = connect_error(&app("localhost", "sslmode=disable")).await;
    assert!(e.contains("no encryption"), "{e}");

    // The certificate user without a client certificate.
    let e = connect_error(&format!(
        "postgres://{CERT_USER}@127.0.0.1:{port}/relay?sslmode=verify-full&sslrootcert={ca}"
    ))
    .await;
    assert!(e.contains("certificate"), "{e}");

    // No sslmode is `prefer`: TLS when the server offers it, without verification.
    round_trip(&app("localhost", "")).await;

    pg.server.assert_running();
    eprintln!("postgres over TLS: {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------
// MariaDB
// ---------------------------------------------------------------------------------------

/// A private MariaDB, run as root (`--user=root`), listening on 127.0.0.1 and 127.0.0.2
/// with TLS; shut down when dropped.
struct MariaDb {
    server: Server,
    port: u16,
    // Dropped after the server: the data directory and the socket.
    dir: tempfile::TempDir,
}

impl MariaDb {
    async fn start(pki: &Pki) -> Self {
        let started = Instant::now();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let data = d.join("data");
        let out = Command::new("mariadb-install-db")
            .args(["--no-defaults", "--auth-root-authentication-method=normal"])
            .args(["--user=root", "--skip-test-db"])
            .arg(format!("--datadir={}", data.display()))
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run mariadb-install-db ({e}); install Debian's mariadb-server")
            });
        assert!(
            out.status.success(),
            "mariadb-install-db failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let root = (0, 0);
        for (file, mode) in [
            ("server.pem", 0o644),
            ("server.key", 0o600),
            ("ca.pem", 0o644),
        ] {
            install(pki, file, d, root, mode);
        }
        eprintln!("mariadb-install-db: {:?}", started.elapsed());
        let port = free_port();
        let mut cmd = Command::new("/usr/sbin/mariadbd");
        cmd.current_dir(d)
            .args(["--no-defaults", "--user=root", "--skip-name-resolve"])
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", d.join("mysqld.sock").display()))
            .arg(format!("--pid-file={}", d.join("mysqld.pid").display()))
            .arg(format!("--port={port}"))
            .args(["--skip-networking=0", "--bind-address=127.0.0.1,127.0.0.2"])
            .arg(format!("--ssl-cert={}", d.join("server.pem").display()))
            .arg(format!("--ssl-key={}", d.join("server.key").display()))
            .arg(format!("--ssl-ca={}", d.join("ca.pem").display()))
            .arg("--innodb-buffer-pool-size=32M");
        let mut server = Server::spawn("mariadbd", cmd, d.join("mariadbd.log"));
        server.wait_port(port).await;
        let db = MariaDb { server, port, dir };
        // The socket file comes a moment after the TCP port.
        let slot = std::sync::Mutex::new(None);
        let (d, s) = (&db, &slot);
        crate::common::wait_until(
            "private mariadbd to accept sessions",
            Duration::from_secs(30).saturating_sub(started.elapsed()),
            || async move {
                match d.admin().connect().await {
                    Ok(conn) => {
                        *s.lock().unwrap() = Some(conn);
                        Ok(())
                    }
                    Err(e) => Err(format!("{e}; log:\n{}", d.server.log())),
                }
            },
        )
        .await;
        let mut admin = slot.into_inner().unwrap().unwrap();
        for sql in [
            "CREATE DATABASE app".to_owned(),
            format!("CREATE USER app@'%' IDENTIFIED BY '{PASSWORD}' REQUIRE SSL"),
            "GRANT ALL ON app.* TO app@'%'".to_owned(),
            "CREATE DATABASE relay".to_owned(),
            format!("CREATE USER '{CERT_USER}'@'%' REQUIRE SUBJECT '/CN={CERT_USER}'"),
            format!("GRANT ALL ON relay.* TO '{CERT_USER}'@'%'"),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut admin)
                .await
                .unwrap();
        }
        eprintln!("private mariadbd ready in {:?}", started.elapsed());
        db
    }

    /// root over the server's socket.
    fn admin(&self) -> sqlx::mysql::MySqlConnectOptions {
        sqlx::mysql::MySqlConnectOptions::new()
            .socket(self.dir.path().join("mysqld.sock"))
            .username("root")
            .ssl_mode(sqlx::mysql::MySqlSslMode::Disabled)
    }
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        self.server.stop("TERM");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_store_over_tls() {
    let started = Instant::now();
    let pki = Pki::new();
    let mut db = MariaDb::start(&pki).await;
    let port = db.port;
    let ca = pki.show("ca.pem");
    let app =
        |host: &str, params: &str| format!("mariadb://app:{PASSWORD}@{host}:{port}/app?{params}");

    // VERIFY_IDENTITY: the chain up to the CA of ssl-ca, and the host name.
    let store = round_trip(&app(
        "localhost",
        &format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"),
    ))
    .await;
    let AnyStore::MySql(my_store) = &store else {
        panic!("not the MySQL store")
    };
    let (_, cipher): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .fetch_one(my_store.pool())
        .await
        .unwrap();
    assert!(!cipher.is_empty(), "the session is not encrypted");
    drop(store);

    // A client certificate instead of a password (REQUIRE SUBJECT), to the address the
    // certificate names.
    let relay = format!(
        "mysql://{CERT_USER}@127.0.0.1:{port}/relay?ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}\
         &ssl-cert={}&ssl-key={}",
        pki.show("client.pem"),
        pki.show("client.key")
    );
    let store = round_trip(&relay).await;
    let AnyStore::MySql(my_store) = &store else {
        panic!("not the MySQL store")
    };
    let user: String = sqlx::query_scalar("SELECT CAST(CURRENT_USER() AS CHAR)")
        .fetch_one(my_store.pool())
        .await
        .unwrap();
    assert_eq!(user, format!("{CERT_USER}@%"));
    drop(store);

    // VERIFY_CA checks the chain but not the name: 127.0.0.2 is not in the certificate.
    round_trip(&app(
        "127.0.0.2",
        &format!("ssl-mode=VERIFY_CA&ssl-ca={ca}"),
    ))
    .await;
    let e = connect_error(&app(
        "127.0.0.2",
        &format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"),
    ))
    .await;
    assert!(e.contains("certificate not valid for name"), "{e}");

    // A CA that did not sign the server's certificate.
    let e = connect_error(&app(
        "localhost",
        &format!(
            "ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
            pki.show("other-ca.pem")
        ),
    ))
    .await;
    assert!(e.contains("TLS") && e.contains("certificate"), "{e}");

    // Plain text: the server refuses it (REQUIRE SSL), without saying why (MariaDB 10.11
    // says the same with require_secure_transport).
    let e = connect_error(&app("localhost", "ssl-mode=DISABLED")).await;
    assert!(e.contains("Access denied"), "{e}");

    // The certificate user without a client certificate.
    let e = connect_error(&format!(
        "mysql://{CERT_USER}@127.0.0.1:{port}/relay?ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"
    ))
    .await;
    assert!(e.contains("Access denied"), "{e}");

    // No ssl-mode is PREFERRED: TLS when the server offers it, without verification.
    round_trip(&app("localhost", "")).await;

    db.server.assert_running();
    eprintln!("mariadb over TLS: {:?}", started.elapsed());
}
