//! `outbox migrate`: create or upgrade the outbox schema (idempotent).

use crate::shared::{GlobalArgs, Missing, connect};
use anyhow::Context as _;
use outbox::AnyStore;
use outbox::store::prelude::*;
use std::process::ExitCode;

/// `outbox migrate`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// PostgreSQL: turn the insert trigger that wakes relays on or off (off saves
    /// producers one pg_notify per inserting statement; relays then poll).
    #[arg(long, env = "OUTBOX_NOTIFY")]
    notify: Option<bool>,
}

/// Runs `outbox migrate`.
pub(crate) async fn run(global: &GlobalArgs, args: &Args) -> anyhow::Result<ExitCode> {
    let Args { notify } = args;
    let store = connect(global, Missing::Create).await?;
    store.migrate().await.context("migration failed")?;
    if let Some(on) = notify {
        match &store {
            AnyStore::Postgres(pg) => pg.set_notify(*on).await?,
            _ => anyhow::bail!("--notify applies to PostgreSQL only"),
        }
    }
    let what = match &store {
        AnyStore::Sqlite(_) | AnyStore::MySql(_) => "table prefix",
        _ => "schema",
    };
    eprintln!("outbox {what} {:?} is migrated", global.schema);
    Ok(ExitCode::SUCCESS)
}
