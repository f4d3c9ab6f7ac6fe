//! The model's transitions against the project's: the table of `docs/state_machine.md`
//! (kept with the code, each row naming what enforces it), the functions and guards the
//! model names (looked up in the source), and the status codes and settle statement of
//! the library.

use outbox_model::{Code, TRANSITIONS};
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The rows of the table under `## Every transition`: (from, to, enforced by).
fn doc_transitions() -> Vec<(String, String, String)> {
    let doc = read("docs/state_machine.md");
    let section = doc
        .split("## Every transition")
        .nth(1)
        .expect("docs/state_machine.md has a section «Every transition»");
    section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2) // the header and its rule
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_owned())
                .collect();
            assert!(cells.len() >= 5, "a row of five columns: {l}");
            (cells[0].clone(), cells[1].clone(), cells[4].clone())
        })
        .collect()
}

#[test]
fn the_model_makes_exactly_the_documented_transitions() {
    let doc = doc_transitions();
    let mut documented: Vec<(&str, &str)> = doc
        .iter()
        .map(|(f, t, _)| (f.as_str(), t.as_str()))
        .collect();
    let mut modelled: Vec<(&str, &str)> = TRANSITIONS.iter().map(|t| (t.from, t.to)).collect();
    documented.sort_unstable();
    modelled.sort_unstable();
    assert_eq!(
        modelled, documented,
        "the model's transitions (left) and docs/state_machine.md's table (right) differ"
    );
    for t in TRANSITIONS {
        let (_, _, enforced) = doc
            .iter()
            .find(|(f, to, _)| f == t.from && to == t.to)
            .expect("matched above");
        assert!(
            enforced.contains(t.doc),
            "{}: the table's «enforced by» for {} → {} does not name {}: {enforced}",
            t.name,
            t.from,
            t.to,
            t.doc
        );
    }
}

#[test]
fn the_code_the_model_names_exists() {
    for t in TRANSITIONS {
        assert!(!t.code.is_empty(), "{} names no code", t.name);
        for code in t.code {
            match *code {
                Code::Fn(file, name) => {
                    let text = read(file);
                    assert!(
                        text.contains(&format!("fn {name}("))
                            || text.contains(&format!("fn {name}<")),
                        "{}: no fn {name} in {file}",
                        t.name
                    );
                }
                Code::Text(file, needle) => assert!(
                    read(file).contains(needle),
                    "{}: {file} no longer holds «{needle}»",
                    t.name
                ),
            }
        }
    }
}

/// The library's status codes are the table's, and the settle statement writes from
/// claimed exactly the statuses the model's settle transitions reach, each under the fence.
#[test]
fn the_settle_statement_writes_what_the_model_settles() {
    let status = read("crates/outbox/src/status.rs");
    for code in ["Pending = 0", "Claimed = 1", "Dispatched = 2", "Dead = 3"] {
        assert!(status.contains(code), "status.rs: {code}");
    }
    let sql = read("crates/outbox/src/store/postgres/sql/settle.sql");
    let mut written: Vec<&str> = Vec::new();
    for update in sql.split("UPDATE").skip(1) {
        // The fence: the claim's token on a live row (a claim keeps `status` 0 since
        // schema version 10; rows claimed before hold 1).
        assert!(
            update.contains("claim_token = $9 AND m.status <= 1")
                || update.contains("claim_token = $9 AND status <= 1"),
            "an UPDATE of settle.sql without the fence: {update}"
        );
        let to = if update.contains("SET status = 2") {
            "dispatched"
        } else if update.contains("SET status = 3") {
            "dead"
        } else if update.contains("SET status = 0") {
            "pending"
        } else {
            panic!("an UPDATE of settle.sql that sets no status: {update}")
        };
        written.push(to);
    }
    written.sort_unstable();
    written.dedup();
    let mut modelled: Vec<&str> = TRANSITIONS
        .iter()
        .filter(|t| t.name.starts_with("settle: ") && t.to != "(deleted)")
        .map(|t| t.to.split(' ').next().unwrap_or(t.to))
        .collect();
    modelled.sort_unstable();
    modelled.dedup();
    assert_eq!(written, modelled);
}
