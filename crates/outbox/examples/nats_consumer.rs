//! A NATS JetStream consumer that turns at-least-once delivery into exactly one business
//! effect, and sends its own follow-up message through the outbox. Copy it.
//!
//! What it does, per message of a durable pull consumer:
//! 1. reads the envelope the relay's NATS sink wrote ([`outbox::envelope::from_nats`]);
//! 2. in **one** PostgreSQL transaction: accepts the message id in the inbox
//!    ([`PgStore::inbox_accept`], insert-first), and only when that is fresh, does the
//!    business change (an invoice row) and enqueues a follow-up message whose id is
//!    derived from the incoming one ([`Envelope::follow_up_id`]) — then commits;
//! 3. acknowledges to JetStream **after** the commit.
//!
//! Every crash point is safe: before the commit nothing happened (JetStream redelivers
//! after `ack_wait`); after the commit but before the ack, the redelivery finds the inbox
//! row and does nothing; a relay that re-publishes a message it had already published
//! (a crash between the broker's confirmation and its mark) is a duplicate like any other.
//! Transaction conflicts are retried by [`outbox::transaction::transaction`]; a database
//! that is down makes the message wait (`nak` with a delay); a message that can never be
//! handled (not an outbox envelope, a payload that is not an order, a value the database
//! or enqueue refuses) is terminated (`term`), logged by id, never retried forever; and
//! `max_deliver` bounds the redeliveries of anything else.
//!
//! Run it (PostgreSQL and NATS with JetStream on their standard ports, the outbox schema
//! migrated with `outbox migrate`; the user guide's quick start,
//! `docs/guide/src/quick-start.md`, walks through it):
//!
//! ```text
//! OUTBOX_DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//! cargo run -p outbox --example nats_consumer
//! ```
//!
//! It expects order messages whose payload is `{"order_id": "<text>", "amount_cents":
//! <integer>}` ([`OrderPlaced`]) and prints one line per message it handles (its id and
//! key, never the payload).
//!
//! Settings (environment): `OUTBOX_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), `OUTBOX_SCHEMA` (default `outbox`),
//! `NATS_URL` (default `nats://127.0.0.1:4222`), `STREAM` (default `ORDERS`) over
//! `SUBJECTS` (default `orders.>`), `DURABLE` (default `billing`, also the inbox consumer
//! name), `FOLLOW_UP_TOPIC` (default `billing.invoice-requested.v1`) and the stream for it,
//! `FOLLOW_UP_STREAM` (default `BILLING`) over `FOLLOW_UP_SUBJECTS` (default `billing.>`).
//! Both streams are created when missing, so the relay can deliver the orders and the
//! follow-ups without any other tool. Stop it with Ctrl-C: the message in hand is finished first.

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use futures::StreamExt as _;
use outbox::postgres::PgStore;
use outbox::transaction::{TransactionError, transaction};
use outbox::{Accepted, Envelope, Message, StoreConfig};
use sqlx::AssertSqlSafe;
use std::future::Future;
use std::time::Duration;

/// What the consumer connects to and under which names.
#[derive(Debug, Clone)]
pub struct Config {
    /// `postgres://…`.
    pub database_url: String,
    /// The outbox schema (its inbox table, its outbox) and where the invoices table lives.
    pub schema: String,
    /// `nats://…`.
    pub nats_url: String,
    /// The JetStream stream to read.
    pub stream: String,
    /// Its subjects, used only when the stream has to be created.
    pub subjects: String,
    /// Durable consumer name; also the inbox consumer name.
    pub durable: String,
    /// The topic of the follow-up message.
    pub follow_up_topic: String,
    /// The stream the relay publishes follow-ups to (created when missing) …
    pub follow_up_stream: String,
    /// … over these subjects (they must cover `follow_up_topic`).
    pub follow_up_subjects: String,
}

impl Config {
    /// From the environment, with the defaults of the module docs.
    pub fn from_env() -> Self {
        let var =
            // An empty variable (`X=$UNSET`) counts as unset.
            |name: &str, default: &str| match std::env::var(name) {
                Ok(v) if !v.is_empty() => v,
                _ => default.into(),
            };
        Config {
            database_url: var(
                "OUTBOX_DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            schema: var("OUTBOX_SCHEMA", "outbox"),
            nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
            stream: var("STREAM", "ORDERS"),
            subjects: var("SUBJECTS", "orders.>"),
            durable: var("DURABLE", "billing"),
            follow_up_topic: var("FOLLOW_UP_TOPIC", INVOICE_REQUESTED),
            follow_up_stream: var("FOLLOW_UP_STREAM", "BILLING"),
            follow_up_subjects: var("FOLLOW_UP_SUBJECTS", "billing.>"),
        }
    }
}

/// The default topic of the follow-up message.
pub const INVOICE_REQUESTED: &str = "billing.invoice-requested.v1";

/// Deliveries of one message before JetStream gives up on it.
pub const MAX_DELIVER: i64 = 20;

/// What the consumer expects in an order message's payload.
#[derive(Debug, serde::Deserialize)]
pub struct OrderPlaced {
    /// The order.
    pub order_id: String,
    /// Its amount, in cents.
    pub amount_cents: i64,
}

/// What handling one message came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// First delivery: the invoice and the follow-up were committed.
    Fresh,
    /// Seen before: nothing was done.
    Duplicate,
    /// Can never be handled: terminated.
    Poison,
    /// The database failed: asked for a redelivery.
    Retry,
}

/// Errors that end the consumer (connecting, creating the stream or the consumer).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The business table. A real service has its own (made by its migrations); no unique key
/// here on purpose: the inbox alone keeps the effect single. Under a transaction-scoped
/// advisory lock, since `CREATE TABLE IF NOT EXISTS` races when two copies start at once.
async fn create_invoices(store: &PgStore, schema: &str) -> Result<(), sqlx::Error> {
    let mut tx = store.pool().begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(format!("{schema}.invoices"))
        .execute(&mut *tx)
        .await?;
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {schema}.invoices (
             id bigserial PRIMARY KEY,
             order_message_id uuid NOT NULL,
             order_id text NOT NULL,
             amount_cents bigint NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now())"
    )))
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// One message, in one transaction (re-run on conflicts): inbox first, then the effect
/// and the follow-up, only when fresh.
pub async fn handle(
    store: &PgStore,
    cfg: &Config,
    envelope: &Envelope,
    order: &OrderPlaced,
) -> Result<Accepted, TransactionError<outbox::Error>> {
    let insert = format!(
        "INSERT INTO {}.invoices (order_message_id, order_id, amount_cents) VALUES ($1, $2, $3)",
        cfg.schema
    );
    // The closure's future owns what it uses (cheap clones: a pool handle, refcounted
    // bytes), as the retry helper may run it more than once.
    transaction(store.pool(), |tx| {
        let (store, insert) = (store.clone(), insert.clone());
        let (consumer, topic) = (cfg.durable.clone(), cfg.follow_up_topic.clone());
        let (envelope, order_id, amount) =
            (envelope.clone(), order.order_id.clone(), order.amount_cents);
        Box::pin(async move {
            let accepted = store.inbox_accept(tx, &consumer, &envelope).await?;
            if accepted == Accepted::Fresh {
                sqlx::query(AssertSqlSafe(insert))
                    .bind(envelope.message_id)
                    .bind(&order_id)
                    .bind(amount)
                    .execute(&mut **tx)
                    .await?;
                let follow_up = Message::json(
                    &topic,
                    &serde_json::json!({ "order_id": order_id, "amount_cents": amount }),
                )?
                // The same id on every redelivery: enqueue keeps one.
                .message_id(envelope.follow_up_id(&topic))
                .key(order_id.clone())
                .causation_id(envelope.message_id.to_string());
                let follow_up = match envelope.correlation_id() {
                    Some(c) => follow_up.correlation_id(c),
                    None => follow_up,
                };
                store.enqueue(tx, &follow_up).await?;
            }
            Ok::<_, outbox::Error>(accepted)
        })
    })
    .await
}

/// Reads, handles and acknowledges until `shutdown` completes; returns how many messages
/// it handled fresh.
///
/// # Errors
/// Connecting to PostgreSQL or NATS, or creating the stream or the consumer.
pub async fn run(cfg: Config, shutdown: impl Future<Output = ()>) -> Result<u64, BoxError> {
    let schema = outbox::Ident::new(&cfg.schema)?;
    let store = PgStore::connect(
        &cfg.database_url,
        StoreConfig {
            schema,
            ..StoreConfig::default()
        },
    )
    .await?;
    create_invoices(&store, &cfg.schema).await?;
    let client = async_nats::connect(&cfg.nats_url).await?;
    let js = jetstream::new(client);
    js.get_or_create_stream(stream::Config {
        name: cfg.follow_up_stream.clone(),
        subjects: vec![cfg.follow_up_subjects.clone()],
        ..Default::default()
    })
    .await?;
    let stream = js
        .get_or_create_stream(stream::Config {
            name: cfg.stream.clone(),
            subjects: vec![cfg.subjects.clone()],
            ..Default::default()
        })
        .await?;
    eprintln!(
        "nats_consumer: reading {} ({}) as {}; follow-ups on {}",
        cfg.stream, cfg.subjects, cfg.durable, cfg.follow_up_topic
    );
    let consumer = stream
        .get_or_create_consumer(
            &cfg.durable,
            pull::Config {
                durable_name: Some(cfg.durable.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                // A bound on redeliveries, whatever goes wrong: after it, JetStream stops
                // delivering the message (an advisory is published) instead of looping.
                max_deliver: MAX_DELIVER,
                ..Default::default()
            },
        )
        .await?;
    let mut messages = consumer.messages().await?;
    let mut fresh = 0u64;
    tokio::pin!(shutdown);
    loop {
        let next = tokio::select! {
            () = &mut shutdown => break,
            next = messages.next() => next,
        };
        let msg = match next {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                // A missed heartbeat or a server restart: the stream resumes on its own.
                eprintln!("nats_consumer: pull error: {e}");
                continue;
            }
            None => break,
        };
        let outcome = handle_one(&store, &cfg, &msg).await;
        if outcome == Handled::Fresh {
            fresh += 1;
        }
        let ack = match outcome {
            Handled::Fresh | Handled::Duplicate => AckKind::Ack,
            Handled::Poison => AckKind::Term,
            Handled::Retry => AckKind::Nak(Some(Duration::from_secs(1))),
        };
        // A lost ack only means one more (harmless) redelivery.
        if let Err(e) = msg.ack_with(ack).await {
            eprintln!("nats_consumer: ack failed: {e}");
        }
    }
    Ok(fresh)
}

/// Decodes and handles one delivery; never panics on what the broker hands over.
pub async fn handle_one(store: &PgStore, cfg: &Config, msg: &jetstream::Message) -> Handled {
    let envelope = match outbox::envelope::from_nats(msg) {
        Ok(e) => e,
        Err(e) => {
            eprintln!(
                "nats_consumer: not an outbox message on {}: {e}",
                msg.subject
            );
            return Handled::Poison;
        }
    };
    let Ok(order) = serde_json::from_slice::<OrderPlaced>(&envelope.payload) else {
        eprintln!(
            "nats_consumer: message {} on {} is not an order (payload not shown)",
            envelope.message_id, envelope.topic
        );
        return Handled::Poison;
    };
    match handle(store, cfg, &envelope, &order).await {
        Ok(Accepted::Fresh) => {
            eprintln!(
                "nats_consumer: message {} (key {}): invoiced, follow-up enqueued",
                envelope.message_id,
                envelope.key.as_deref().unwrap_or("-")
            );
            Handled::Fresh
        }
        Ok(Accepted::Duplicate) => {
            eprintln!(
                "nats_consumer: message {} (key {}): a duplicate, skipped",
                envelope.message_id,
                envelope.key.as_deref().unwrap_or("-")
            );
            Handled::Duplicate
        }
        // The database is down or busy, or the commit's outcome is unknown: a redelivery
        // is safe (the inbox answers Duplicate when it had committed).
        Err(TransactionError::Exhausted { .. } | TransactionError::CommitUnknown(_)) => {
            Handled::Retry
        }
        Err(TransactionError::Failed(e)) if e.is_transient() => {
            eprintln!(
                "nats_consumer: message {}: {e} (will retry)",
                envelope.message_id
            );
            Handled::Retry
        }
        // Refused for what it carries (a value the database or enqueue rejects): it would
        // fail the same way on every redelivery.
        Err(e) => {
            eprintln!(
                "nats_consumer: message {} can never be handled: {e}",
                envelope.message_id
            );
            Handled::Poison
        }
    }
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = Config::from_env();
    match run(cfg, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
    {
        Ok(fresh) => {
            eprintln!("nats_consumer: stopped after {fresh} fresh messages");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "nats_consumer: {e} (is the outbox migrated in this database and schema? `outbox migrate` with the same OUTBOX_DATABASE_URL and OUTBOX_SCHEMA)"
            );
            std::process::ExitCode::FAILURE
        }
    }
}
