//! `outbox enqueue`: one message in its own transaction.

use crate::shared::{GlobalArgs, open_checked, out};
use outbox::Message;
use std::process::ExitCode;

/// `outbox enqueue`'s options.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Topic, e.g. orders.order-placed.v1.
    #[arg(long)]
    topic: String,
    /// Ordering / partition key.
    #[arg(long)]
    key: Option<String>,
    /// Message id (UUID); a fresh UUIDv7 when absent. Re-using one is idempotent.
    #[arg(long)]
    id: Option<uuid::Uuid>,
    /// Header NAME=VALUE (repeatable).
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Payload text; read from stdin when absent.
    #[arg(long)]
    payload: Option<String>,
}

/// Runs `outbox enqueue`.
pub(crate) async fn run(global: &GlobalArgs, args: &Args) -> anyhow::Result<ExitCode> {
    let Args {
        topic,
        key,
        id,
        headers,
        payload,
    } = args;
    let store = open_checked(global).await?;
    let payload = match payload {
        Some(p) => p.clone().into_bytes(),
        None => {
            use tokio::io::AsyncReadExt;
            let mut buf = Vec::new();
            tokio::io::stdin().read_to_end(&mut buf).await?;
            buf
        }
    };
    let mut msg = Message::new(topic.clone(), payload);
    if let Some(k) = key {
        msg = msg.key(k.clone());
    }
    if let Some(id) = id {
        msg = msg.message_id(*id);
    }
    for (k, v) in headers {
        msg = msg.header(k.clone(), v.clone());
    }
    let enqueued = store.enqueue_alone(&msg).await?;
    out(&serde_json::json!({"id": enqueued.id, "message_id": enqueued.message_id, "inserted": enqueued.inserted}).to_string());
    Ok(ExitCode::SUCCESS)
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("header {s:?} must be NAME=VALUE"))
}
