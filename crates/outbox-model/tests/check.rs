//! The model checked: the protocol as built passes every property; each seeded bug is
//! found, and its counterexample printed. Run with `--nocapture` to see the states
//! explored and the traces.

use outbox_model::{Bug, Config, Outbox, render};
use stateright::{Checker, HasDiscoveries, Model};
use std::time::Instant;

/// Two relays (the first keeps dispatched rows, the second deletes them) and three
/// messages: two of one ordered key, one not ordered; one fault and one operator action
/// per run.
fn two_relays_three_messages(bug: Option<Bug>) -> Config {
    Config {
        relays: vec![false, true],
        messages: vec![Some(0), Some(0), None],
        skip_dead: false,
        max_attempts: 2,
        faults: 1,
        operations: 1,
        bug,
    }
}

/// Checks `config` to the end; prints what was explored.
fn check(name: &str, config: Config) -> impl Checker<Outbox> + use<> {
    let began = Instant::now();
    let checker = Outbox(config).checker().spawn_bfs().join();
    println!(
        "{name}: {} states ({} unique), depth {}, {:.1?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        began.elapsed()
    );
    checker
}

#[test]
fn two_relays_three_messages_strict_order() {
    let checker = check(
        "2 relays × 3 messages, strict order, 1 fault",
        two_relays_three_messages(None),
    );
    checker.assert_properties();
}

#[test]
fn two_relays_three_messages_skip_dead() {
    let config = Config {
        skip_dead: true,
        ..two_relays_three_messages(None)
    };
    let checker = check(
        "2 relays × 3 messages, --ordered-skip-dead, 1 fault",
        config,
    );
    // Nothing is parked when dead letters do not hold their key.
    for (name, path) in checker.discoveries() {
        if name != "a row is parked behind a dead letter" {
            assert!(
                !Outbox(Config {
                    skip_dead: true,
                    ..two_relays_three_messages(None)
                })
                .properties()
                .iter()
                .any(|p| p.name == name && p.expectation.discovery_is_failure()),
                "{name}:\n{}",
                render(&path)
            );
        }
    }
}

#[test]
fn three_relays_two_messages() {
    let config = Config {
        relays: vec![false, true, false],
        messages: vec![Some(0), Some(0)],
        faults: 2,
        ..two_relays_three_messages(None)
    };
    let checker = check("3 relays × 2 messages (one ordered key), 2 faults", config);
    for p in checker.model().properties() {
        if p.expectation.discovery_is_failure() {
            checker.assert_no_discovery(p.name);
        }
    }
}

/// Two faults per run: every pair of crashes, stalls, lost confirmations, failures and
/// shutdowns. About 30 s in release mode (`.ci/run` runs it).
#[test]
#[ignore = "about 30 s in release mode; .ci/run runs it"]
fn two_relays_three_messages_two_faults() {
    let config = Config {
        faults: 2,
        ..two_relays_three_messages(None)
    };
    check("2 relays × 3 messages, strict order, 2 faults", config).assert_properties();
}

/// Checks the model with `bug` seeded and asserts `property` fails; prints the trace.
fn finds(bug: Bug, property: &'static str) {
    let began = Instant::now();
    let checker = Outbox(two_relays_three_messages(Some(bug)))
        .checker()
        .finish_when(HasDiscoveries::AnyOf([property].into()))
        .spawn_bfs()
        .join();
    println!(
        "seeded bug {bug:?}: found after {} states ({} unique), {:.1?}",
        checker.state_count(),
        checker.unique_state_count(),
        began.elapsed()
    );
    let Some(path) = checker.discovery(property) else {
        panic!("the checker did not find {bug:?} by «{property}»");
    };
    println!("{bug:?} breaks «{property}»:\n{}", render(&path));
}

#[test]
fn finds_a_settle_without_the_token_check() {
    finds(Bug::SettleWithoutToken, "a stale claimant changes nothing");
}

#[test]
fn finds_an_ordered_claim_that_ignores_the_key() {
    finds(
        Bug::OrderedClaimIgnoresKey,
        "no message of an ordered key is published before an earlier one is confirmed, skipped dead or discarded",
    );
}

#[test]
fn finds_a_mark_without_an_outcome() {
    finds(
        Bug::MarkWithoutOutcome,
        "no message is marked dispatched without a confirmation of it",
    );
}
