//! The `outbox` binary end to end, in one test binary: the CLI against PostgreSQL and NATS
//! (`cli`), MariaDB producers and relays (`mariadb`), operations (`operations`), traces
//! (`traces`), logs without secrets (`no_secrets_in_logs`) and the admin server
//! (`dashboard`), its listeners under load and their limits (`listeners`), the flags a
//! person guesses (`flags`), the JetStream streams a route needs (`streams`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cli;
mod common;
mod dashboard;
mod flags;
mod listeners;
mod mariadb;
mod no_secrets_in_logs;
mod operations;
mod streams;
mod traces;
