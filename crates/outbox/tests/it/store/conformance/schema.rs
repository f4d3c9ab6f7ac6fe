//! Store conformance: the schema check. A store over tables nobody migrated says so, with
//! the schema or prefix and both versions, and a relay on it stops at once with that error.

use super::*;

pub(crate) async fn an_unmigrated_store_is_named_not_guessed<B: Backend>() {
    let b = B::create("unmig", DEFAULT_MAX).await;
    let (store, name) = b.unmigrated().await;
    let expected = B::SCHEMA_VERSION;
    match store.check_schema().await {
        Err(Error::NotMigrated {
            schema,
            found,
            expected: want,
        }) => {
            assert_eq!(schema, name);
            assert_eq!((found, want), (0, expected));
        }
        other => panic!("{:?}: expected NotMigrated, got {other:?}", B::KIND),
    }
    let (sink, seen) = RecordingSink::new();
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        Relay::new(store, sink, relay_config("relay-unmigrated"))
            .spawn()
            .wait(),
    )
    .await
    .expect("a relay on an unmigrated store must stop by itself");
    assert!(
        matches!(r, Err(RelayError::Store(Error::NotMigrated { .. }))),
        "{r:?}"
    );
    assert!(seen.lock().unwrap().is_empty());
    // The migrated store beside it is untouched.
    b.store().check_schema().await.unwrap();
}
