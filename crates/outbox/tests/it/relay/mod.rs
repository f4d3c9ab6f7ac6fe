//! The relay as a whole, over real stores and sinks: what it decides over a store
//! (`relay_suite`, on SQLite with recording sinks), relays competing over one outbox, a
//! crash between the broker's confirmation and the mark, per-key ordering, what an idle
//! relay asks of its store, bad input and hostile sizes refused or quarantined where they
//! enter, and SQLite end to end into a file.

mod bad_input;
mod concurrent_relays;
mod confirm_crash;
mod hostile_sizes;
mod idle_relay;
mod jobs_e2e;
pub(crate) mod ordering;
mod relay_suite;
mod sqlite_e2e;
