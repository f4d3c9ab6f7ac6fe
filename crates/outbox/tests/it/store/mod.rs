//! The stores against the real databases: the store contract as one suite
//! ([`conformance`]) instantiated once per store (`conformance_postgres`,
//! `conformance_mysql`, `conformance_sqlite`, whose `Backend`s the other rooms borrow), and
//! what each store does beyond it: the transaction retry, the SQL entry points' header
//! checks, TLS to the database, database outages (and the relay's log of one), the cleanup
//! horizon and the wake-up signals.

#[macro_use]
pub(crate) mod conformance;

mod cleanup_horizon;
pub(crate) mod conformance_mysql;
pub(crate) mod conformance_postgres;
pub(crate) mod conformance_sqlite;
mod sql_enqueue_headers;
mod store_outage;
mod store_outage_log;
mod store_tls;
mod transaction;
mod wakeup;
