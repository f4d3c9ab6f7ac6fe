//! `outbox serve`: the admin dashboard, its JSON API, /metrics and the probes.

use crate::dashboard;
use crate::serve;
use crate::shared::{
    GlobalArgs, Missing, USAGE, connect, error_chain, shutdown_on_signal, sqlite_path,
};
use outbox::store::prelude::*;
use std::process::ExitCode;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// `outbox serve`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// HOST:PORT to listen on.
    #[arg(long, env = "OUTBOX_ADMIN_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    #[command(flatten)]
    auth: dashboard::auth::AuthArgs,
    #[command(flatten)]
    limits: super::status::LimitsArgs,
    // As the relays run: which dead letters block their key.
    #[command(flatten)]
    ordering: super::OrderingArgs,
}

/// Runs `outbox serve`.
pub(crate) async fn run(global: &GlobalArgs, args: &Args) -> anyhow::Result<ExitCode> {
    let Args {
        listen,
        auth,
        limits,
        ordering,
    } = args;
    let tokens = match dashboard::auth::Tokens::load(auth) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            return Ok(ExitCode::from(USAGE));
        }
    };
    let store = Arc::new(connect(global, Missing::Refuse).await?);
    store.check_schema().await?;
    let cancel = CancellationToken::new();
    tokio::spawn(shutdown_on_signal(cancel.clone()));
    let ready = Arc::new(serve::Ready::new(
        store.clone(),
        sqlite_path(&global.database_url).map(std::path::PathBuf::from),
        false,
    ));
    let admin = dashboard::Admin {
        store,
        ready,
        limits: limits.limits(),
        ordering: ordering.ordering(),
    };
    dashboard::start(
        "--listen",
        listen,
        tokens,
        admin,
        serve::recorder()?,
        cancel.clone(),
    )
    .await?;
    cancel.cancelled().await;
    Ok(ExitCode::SUCCESS)
}
