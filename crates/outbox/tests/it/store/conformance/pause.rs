//! Store conformance: the pause switch.

use super::*;
use outbox::store::prelude::*;

/// The switch is one row: set and cleared with a reason, its change time on the database
/// clock, and producers keep writing while it is on. The claim statement itself reads it:
/// a claim while paused takes nothing, the next one after the resume takes the rows.
pub(crate) async fn pause_switch_is_kept_on_the_database_clock<B: Backend>() {
    let b = B::create("pause", DEFAULT_MAX).await;
    let store = b.store();
    let p = store.pause_state().await.unwrap();
    assert!(!p.paused && p.reason.is_none(), "{p:?}");

    let t0 = b.db_now_us().await;
    store.set_pause(Some("maintenance window")).await.unwrap();
    let t1 = b.db_now_us().await;
    let p = store.pause_state().await.unwrap();
    assert!(p.paused);
    assert_eq!(p.reason.as_deref(), Some("maintenance window"));
    let changed = p.changed_at.unwrap().timestamp_micros();
    assert!(
        changed >= t0 - 1_000 && changed <= t1 + 1_000,
        "changed_at on the database clock: {changed} vs [{t0}, {t1}]"
    );
    let later = b.enqueue_all(&messages("t.pause.v1", 3)).await;
    assert!(
        later.iter().all(|e| e.inserted),
        "producers write while paused"
    );
    assert_eq!(store.counts().await.unwrap().pending, 3);
    let c = claim(&store, "r", 100, LONG).await;
    assert!(
        c.messages.is_empty() && c.malformed.is_empty(),
        "a claim while paused takes nothing: {:?}",
        claim_ids(&c)
    );
    assert_eq!(store.counts().await.unwrap().pending, 3);

    // Pausing again replaces the reason; resuming clears it.
    store.set_pause(Some("second window")).await.unwrap();
    let p = store.pause_state().await.unwrap();
    assert_eq!(p.reason.as_deref(), Some("second window"));
    store.set_pause(None).await.unwrap();
    let p = store.pause_state().await.unwrap();
    assert!(!p.paused && p.reason.is_none(), "{p:?}");
    let c = claim(&store, "r", 100, LONG).await;
    assert_eq!(
        claim_ids(&c),
        later.iter().map(|e| e.id).collect::<Vec<_>>(),
        "the first claim after the resume"
    );
}

/// One table of topic patterns, run against every store: a pattern's punctuation is
/// matched literally in SQL (quotes, backslashes, `LIKE` and regex metacharacters, `<`,
/// which SQLite's `regex` crate would read as a word boundary were it escaped with a
/// backslash), each pause holds exactly the topics the pattern matches in the relay
/// ([`TopicPattern::matches`]), and text shaped like SQL stays a value. The same table
/// then selects the dead letters of those topics by pattern.
pub(crate) async fn topic_pause_patterns_hold_the_same_topics_on_every_store<B: Backend>() {
    use outbox::sink::router::TopicPattern;
    let b = B::create("pausetable", DEFAULT_MAX).await;
    let store = b.store();
    let topics = [
        "orders.v2",
        "orders.<v2",
        "orders.v2<",
        "a'b",
        "a\"b",
        "a\\b",
        "a%b",
        "a_b",
        "axb",
        "a(b)",
        "a[b]",
        "a{2}",
        "aa",
        "a|b",
        "a?b",
        "a+b",
        "a$b",
        "a^b",
        "o';DROP_TABLE_x;--",
        "é.ü",
        "a.b",
        "a.b.c",
    ];
    let table: [(&str, &[&str]); 19] = [
        ("orders.<v2", &["orders.<v2"]),
        ("orders.v2<", &["orders.v2<"]),
        ("a'b", &["a'b"]),
        ("a\"b", &["a\"b"]),
        ("a\\b", &["a\\b"]),
        ("a%b", &["a%b"]),
        ("a_b", &["a_b"]),
        ("a(b)", &["a(b)"]),
        ("a[b]", &["a[b]"]),
        ("a{2}", &["a{2}"]),
        ("a|b", &["a|b"]),
        ("a?b", &["a?b"]),
        ("a+b", &["a+b"]),
        ("a$b", &["a$b"]),
        ("a^b", &["a^b"]),
        ("o';DROP_TABLE_x;--", &["o';DROP_TABLE_x;--"]),
        ("é.*", &["é.ü"]),
        ("a.>", &["a.b", "a.b.c"]),
        ("*.b", &["a.b"]),
    ];
    for t in topics {
        b.enqueue_all(&messages(t, 1)).await;
    }
    let mut wrong = Vec::new();
    for (pattern, held) in table {
        let p = TopicPattern::parse(pattern).unwrap();
        let by_relay: Vec<&str> = topics.iter().copied().filter(|t| p.matches(t)).collect();
        assert_eq!(by_relay, held, "{pattern}: the table agrees with the relay");
        store.pause_topic(&p, "table", "ci").await.unwrap();
        let c = claim(&store, "r", 1_000, LONG).await;
        let mut claimed: Vec<&str> = c
            .messages
            .iter()
            .map(|m| topics.iter().copied().find(|t| *t == m.topic).unwrap())
            .collect();
        store.release(c.token, &claim_ids(&c)).await.unwrap();
        claimed.sort_unstable();
        let mut want: Vec<&str> = topics
            .iter()
            .copied()
            .filter(|t| !held.contains(t))
            .collect();
        want.sort_unstable();
        if claimed != want {
            let not_claimed: Vec<&str> = topics
                .iter()
                .copied()
                .filter(|t| !claimed.contains(t))
                .collect();
            wrong.push(format!("{pattern:?} held {not_claimed:?}, not {held:?}"));
        }
        assert!(store.resume_topic(pattern).await.unwrap(), "{pattern}");
    }
    assert!(wrong.is_empty(), "{:?}: {wrong:#?}", B::KIND);
    assert_eq!(store.counts().await.unwrap().pending, topics.len() as i64);

    // The same table selects dead letters by topic (the operator's `--topic`).
    let c = claim(&store, "r", 1_000, LONG).await;
    let dead: Vec<outbox::store::Dead> = c
        .messages
        .iter()
        .map(|m| outbox::store::Dead {
            id: m.id,
            error: "permanent: table".into(),
        })
        .collect();
    store.quarantine(c.token, &dead).await.unwrap();
    for (pattern, held) in table {
        let sel = outbox::store::DeadSelector {
            topic: Some(TopicPattern::parse(pattern).unwrap()),
            ..Default::default()
        };
        let n = store.count_dead(&sel).await.unwrap();
        if n != held.len() as u64 {
            wrong.push(format!(
                "{pattern:?} selected {n} dead letters, not {}",
                held.len()
            ));
        }
    }
    assert!(wrong.is_empty(), "{:?}: {wrong:#?}", B::KIND);
}
