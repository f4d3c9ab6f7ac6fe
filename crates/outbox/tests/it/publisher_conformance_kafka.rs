//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) against the
//! kafka sink and its real server; again with `envelope=cloudevents` in binary and
//! structured mode (here rather than in `publisher_conformance_cloudevents.rs`: the Kafka
//! tests run in a step of their own, selected by this module's name).

#![cfg(feature = "kafka")]
#![allow(clippy::unwrap_used)]

publisher_conformance_tests!(crate::publisher_conformance::kafka::KafkaHarness);

mod cloudevents_binary {
    publisher_conformance_tests!(
        crate::publisher_conformance::kafka::KafkaHarness<{ crate::publisher_conformance::CE }>
    );
}

mod cloudevents_structured {
    publisher_conformance_tests!(
        crate::publisher_conformance::kafka::KafkaHarness<
            { crate::publisher_conformance::CE_STRUCTURED },
        >
    );
}
