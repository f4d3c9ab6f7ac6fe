//! What the admin dashboard reads of every store: where a message is now (by message id,
//! by key within a topic or across topics) and what was dispatched and died per minute.

use super::{Backend, DEFAULT_MAX, LONG, claim};
use outbox::Message;
use outbox::store::Dead;
use outbox::store::lookup::MessageQuery;
use outbox::store::prelude::*;

/// Four messages of one key (one pending, one claimed, one dispatched, one dead) and one
/// of the same key on another topic: each is found where it is, newest first; an unknown
/// id finds nothing; the last hour counts the dispatched and the dead row in this minute.
pub(crate) async fn messages_are_found_where_they_are_and_minutes_counted<B: Backend>() {
    let b = B::create("lookup", DEFAULT_MAX).await;
    let store = b.store();
    let msgs: Vec<Message> = (0..4)
        .map(|i| Message::new("t.find.v1", format!("p{i}").into_bytes()).key("cust-7"))
        .collect();
    let rows = b.enqueue_all(&msgs).await;
    // Claim the first three: dispatch one, quarantine one, keep one claimed.
    let c = claim(&store, "finder-relay", 3, LONG).await;
    assert_eq!(c.messages.len(), 3);
    store.mark_dispatched(c.token, &[rows[0].id]).await.unwrap();
    store
        .quarantine(
            c.token,
            &[Dead {
                id: rows[1].id,
                error: "permanent: refused by the broker".into(),
            }],
        )
        .await
        .unwrap();
    let other = b
        .enqueue_all(&[Message::new("t.elsewhere.v1", b"x".to_vec()).key("cust-7")])
        .await;

    let by_id = |i: usize| MessageQuery::MessageId(rows[i].message_id);
    let found = store.find_messages(&by_id(0), 10).await.unwrap();
    assert_eq!(found.len(), 1);
    let f = &found[0];
    assert_eq!(
        (f.id, f.status, f.topic.as_str(), f.key.as_deref()),
        (rows[0].id, "dispatched", "t.find.v1", Some("cust-7"))
    );
    assert!(f.dispatched_at.is_some_and(|d| d >= f.occurred_at), "{f:?}");
    assert_eq!(f.payload_bytes, 2);
    let dead = &store.find_messages(&by_id(1), 10).await.unwrap()[0];
    assert_eq!(dead.status, "dead");
    assert_eq!(
        dead.last_error.as_deref(),
        Some("permanent: refused by the broker")
    );
    let claimed = &store.find_messages(&by_id(2), 10).await.unwrap()[0];
    assert_eq!(claimed.status, "claimed");
    assert_eq!(claimed.claimed_by.as_deref(), Some("finder-relay"));
    assert!(
        claimed
            .locked_until
            .is_some_and(|t| t > claimed.occurred_at),
        "{claimed:?}"
    );
    assert_eq!(claimed.attempts, 1);
    let pending = &store.find_messages(&by_id(3), 10).await.unwrap()[0];
    assert_eq!(pending.status, "pending");
    assert_eq!(pending.attempts, 0);
    assert!(
        store
            .find_messages(&MessageQuery::MessageId(uuid::Uuid::new_v4()), 10)
            .await
            .unwrap()
            .is_empty()
    );

    // By key: within the topic, newest first; across topics, the other one too; limited.
    let key = |topic: Option<&str>| MessageQuery::Key {
        key: "cust-7".into(),
        topic: topic.map(str::to_owned),
    };
    let in_topic = store
        .find_messages(&key(Some("t.find.v1")), 10)
        .await
        .unwrap();
    let ids: Vec<i64> = in_topic.iter().map(|m| m.id).collect();
    assert_eq!(ids, vec![rows[3].id, rows[2].id, rows[1].id, rows[0].id]);
    let all = store.find_messages(&key(None), 10).await.unwrap();
    assert_eq!(all.len(), 5);
    assert_eq!(all[0].id, other[0].id);
    assert_eq!(store.find_messages(&key(None), 2).await.unwrap().len(), 2);
    let none = MessageQuery::Key {
        key: "cust-7".into(),
        topic: Some("t.nothing.v1".into()),
    };
    assert!(store.find_messages(&none, 10).await.unwrap().is_empty());

    // The last hour, a minute per entry, oldest first: both rows in the current minute
    // (or the one before, when the minute turned in between).
    let hour = store.throughput(60).await.unwrap();
    assert_eq!(hour.len(), 60);
    assert_eq!(hour[0].minutes_ago, 59);
    assert_eq!(hour[59].minutes_ago, 0);
    let recent: (i64, i64) = hour[58..]
        .iter()
        .fold((0, 0), |a, m| (a.0 + m.dispatched, a.1 + m.dead));
    assert_eq!(recent, (1, 1), "{hour:?}");
    let total: i64 = hour.iter().map(|m| m.dispatched + m.dead).sum();
    assert_eq!(total, 2);
    assert_eq!(store.throughput(0).await.unwrap().len(), 0);
}
