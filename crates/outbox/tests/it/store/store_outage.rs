//! The stores during a database outage, made with a TCP proxy in front of the real
//! database: the PostgreSQL listener says once that it lost its connection and once that it
//! is back (with the outage's length), never once per retry; a call into a store whose
//! server stopped answering fails within the acquire bound; connecting to a server that
//! accepts TCP and never answers fails within the same bound.

#![allow(clippy::unwrap_used)]

use crate::common::{
    PgSchema, ProxyMode, TcpProxy, capture_logs, mysql_connect, mysql_url, pg_connect, pg_url,
    silent_server,
};
use outbox::mysql::MySqlStore;
use outbox::postgres::PgStore;
use outbox::store::ACQUIRE_TIMEOUT;
use outbox::store::prelude::*;
use outbox::{Error, Store, StoreConfig};
use sqlx::ConnectOptions as _;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// Host and port of a database URL, and the URL pointed at `port` on 127.0.0.1 instead.
fn via(url: &str, host: &str, port: u16, proxy_port: u16) -> String {
    let from = format!("{host}:{port}");
    assert!(url.contains(&from), "{url} does not name {from}");
    url.replacen(&from, &format!("127.0.0.1:{proxy_port}"), 1)
}

fn pg_upstream() -> (String, u16) {
    let o = sqlx::postgres::PgConnectOptions::from_str(&pg_url()).unwrap();
    (o.get_host().to_owned(), o.get_port())
}

fn mysql_upstream() -> (String, u16) {
    let o = sqlx::mysql::MySqlConnectOptions::from_str(&mysql_url()).unwrap();
    let url = o.to_url_lossy();
    (
        url.host_str().unwrap().to_owned(),
        url.port().unwrap_or(3306),
    )
}

/// The backend pid of the listener of `schema`, once it listens.
async fn listener_pid(admin: &mut sqlx::PgConnection, schema: &str) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE query = $1 AND backend_type = 'client backend'",
    )
    .bind(format!("LISTEN \"{schema}_messages\""))
    .fetch_optional(admin)
    .await
    .unwrap()
}

async fn wait_for_listener(admin: &mut sqlx::PgConnection, schema: &str, not: Option<i32>) -> i32 {
    let found = tokio::sync::Mutex::new((admin, None));
    let f = &found;
    let what = format!("a listener on {schema}_messages");
    crate::common::wait_until(&what, Duration::from_secs(20), || async move {
        let mut f = f.lock().await;
        match listener_pid(f.0, schema).await {
            Some(pid) if Some(pid) != not => {
                f.1 = Some(pid);
                Ok(())
            }
            other => Err(format!("listener {other:?}, not {not:?}")),
        }
    })
    .await;
    found.into_inner().1.unwrap()
}

/// A 2 s outage of the PostgreSQL listener's connection (the proxy closes every
/// connection and refuses new ones meanwhile, so the listener retries several times):
/// exactly one WARN line for the loss, exactly one INFO line for the reconnection carrying
/// the outage's length (at least the 2 s), and notifications wake the relay again after.
#[tokio::test] // current thread: the log capture follows this thread's tasks
async fn pg_listener_logs_its_loss_and_its_return_once_each() {
    let (logs, _guard) = capture_logs();
    drop(pg_connect().await);
    let (host, port) = pg_upstream();
    let proxy = TcpProxy::start((host.clone(), port)).await;
    let schema = PgSchema::new("listen_outage");
    let store = PgStore::connect(
        &via(&pg_url(), &host, port, proxy.port),
        StoreConfig {
            schema: schema.ident(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    let mut wake = store.wakeups();
    let mut admin = pg_connect().await;
    let first = wait_for_listener(&mut admin, &schema.name, None).await;
    // The server runs LISTEN before the listener has read the answer; an outage in between
    // fails its first connect ("cannot connect") instead of losing a connection. Its
    // connect wakes the relay once the LISTEN has returned: wait for that.
    tokio::time::timeout(Duration::from_secs(5), wake.changed())
        .await
        .expect("the listener's connect wakes the relay")
        .unwrap();

    proxy.set(ProxyMode::Refuse);
    let outage = Duration::from_secs(2);
    tokio::time::sleep(outage).await;
    proxy.set(ProxyMode::Forward);
    let second = wait_for_listener(&mut admin, &schema.name, Some(first)).await;
    assert_ne!(first, second);

    // Notifications work again (the row is enqueued directly, not through the proxy).
    wake.borrow_and_update();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {}.enqueue('t.outage.v1', 'x'::bytea)",
        schema.name
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(5), wake.changed())
        .await
        .expect("a notification after the reconnection")
        .unwrap();

    let text = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    let listener_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("outbox listener"))
        .collect();
    let warns: Vec<&&str> = listener_lines
        .iter()
        .filter(|l| l.contains(" WARN "))
        .collect();
    let infos: Vec<&&str> = listener_lines
        .iter()
        .filter(|l| l.contains(" INFO "))
        .collect();
    assert_eq!(
        (warns.len(), infos.len(), listener_lines.len()),
        (1, 1, 2),
        "one WARN for the loss, one INFO for the return, nothing else:\n{text}"
    );
    assert!(warns[0].contains("lost its connection"), "{text}");
    assert!(infos[0].contains("reconnected"), "{text}");
    let secs: f64 = infos[0]
        .split("outage=")
        .nth(1)
        .and_then(|rest| rest.split('s').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no outage=<secs>s in {:?}", infos[0]));
    assert!(
        secs >= outage.as_secs_f64() && secs < 15.0,
        "outage {secs} s, expected about {outage:?}"
    );
}

/// A store whose server stops answering (the proxy holds every byte): a call that needs a
/// connection fails within the acquire bound instead of waiting on the dead connection.
#[tokio::test]
async fn a_call_fails_within_the_acquire_bound_when_the_server_stops_answering() {
    drop(pg_connect().await);
    drop(mysql_connect().await);
    let bound = ACQUIRE_TIMEOUT + Duration::from_secs(2);
    assert!(ACQUIRE_TIMEOUT <= Duration::from_secs(5));

    let (host, port) = pg_upstream();
    let pg_proxy = TcpProxy::start((host.clone(), port)).await;
    let schema = PgSchema::new("stall");
    let pg = PgStore::connect(
        &via(&pg_url(), &host, port, pg_proxy.port),
        StoreConfig {
            schema: schema.ident(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    pg.migrate().await.unwrap();

    let (host, port) = mysql_upstream();
    let my_proxy = TcpProxy::start((host.clone(), port)).await;
    let prefix = crate::common::MySqlPrefix::new("stall");
    let my = MySqlStore::connect(
        &via(&mysql_url(), &host, port, my_proxy.port),
        StoreConfig {
            schema: prefix.ident(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    my.migrate().await.unwrap();

    for (name, store, proxy) in [
        ("PostgreSQL", &pg as &dyn Store, &pg_proxy),
        ("MariaDB", &my as &dyn Store, &my_proxy),
    ] {
        store.counts().await.unwrap();
        proxy.set(ProxyMode::Stall);
        let start = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(30), store.counts())
            .await
            .unwrap_or_else(|_| panic!("{name}: counts() still waiting after 30 s"));
        let took = start.elapsed();
        assert!(r.is_err(), "{name}: a stalled server answered: {r:?}");
        assert!(
            took <= bound,
            "{name}: counts() failed after {took:?}, beyond the {bound:?} bound: {r:?}"
        );
        assert!(
            r.unwrap_err().is_transient(),
            "{name}: the relay retries it"
        );
        proxy.set(ProxyMode::Forward);
    }
}

/// Connecting a store to a server that accepts TCP and never answers fails within the
/// bound, saying it timed out.
#[tokio::test]
async fn connecting_to_a_silent_server_fails_within_the_bound() {
    let (port, _server) = silent_server().await;
    let bound = ACQUIRE_TIMEOUT + Duration::from_secs(2);
    for url in [
        format!("postgres://postgres@127.0.0.1:{port}/test"),
        format!("mysql://root@127.0.0.1:{port}/test"),
    ] {
        let start = Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(30),
            outbox::AnyStore::connect(&url, StoreConfig::default()),
        )
        .await
        .unwrap_or_else(|_| panic!("{url}: connect still waiting after 30 s"));
        let took = start.elapsed();
        match r {
            Err(e @ Error::Timeout(_)) => {
                assert!(took <= bound, "{url}: {e} after {took:?}");
                assert!(e.to_string().contains("timed out"), "{e}");
            }
            Err(e) => panic!("{url}: expected a timeout, got {e}"),
            Ok(_) => panic!("{url}: connected to a silent server"),
        }
    }
}
