//! Store conformance: the pause switch.

use super::*;

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
