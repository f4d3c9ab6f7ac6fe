//! The stores during a database outage, made with a TCP proxy in front of the real
//! database: a call into a store whose server stopped answering fails within the acquire
//! bound; connecting to a server that accepts TCP and never answers fails within the same
//! bound.

#![allow(clippy::unwrap_used)]

mod common;

use common::{
    PgSchema, ProxyMode, TcpProxy, mysql_connect, mysql_url, pg_connect, pg_url, silent_server,
};
use outbox::mysql::MySqlStore;
use outbox::postgres::PgStore;
use outbox::store::ACQUIRE_TIMEOUT;
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
    let prefix = common::MySqlPrefix::new("stall");
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
