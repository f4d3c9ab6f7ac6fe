//! The publisher conformance suite (`tests/publisher_conformance/mod.rs`) with the
//! CloudEvents envelope (`envelope=cloudevents`), once per sink and content mode against
//! the real servers: every case reads the messages back through the same
//! `outbox::envelope::from_*` decoders, which must give the same envelope as the outbox
//! envelope does (message id, topic, key, occurred-at, every header, payload bytes).

#![allow(clippy::unwrap_used)]

#[cfg(feature = "http")]
mod http_binary {
    publisher_conformance_tests!(
        crate::publisher_conformance::http::HttpHarness<{ crate::publisher_conformance::CE }>
    );
}

#[cfg(feature = "http")]
mod http_structured {
    publisher_conformance_tests!(
        crate::publisher_conformance::http::HttpHarness<
            { crate::publisher_conformance::CE_STRUCTURED },
        >
    );
}

/// NATS: structured mode, the only one of the binding.
#[cfg(feature = "nats")]
mod nats_structured {
    publisher_conformance_tests!(
        crate::publisher_conformance::nats::NatsHarness<{ crate::publisher_conformance::CE }>
    );
}

#[cfg(feature = "rabbitmq")]
mod rabbitmq_binary {
    publisher_conformance_tests!(
        crate::publisher_conformance::rabbitmq::RabbitMqHarness<
            { crate::publisher_conformance::CE },
        >
    );
}

#[cfg(feature = "rabbitmq")]
mod rabbitmq_structured {
    publisher_conformance_tests!(
        crate::publisher_conformance::rabbitmq::RabbitMqHarness<
            { crate::publisher_conformance::CE_STRUCTURED },
        >
    );
}

#[cfg(feature = "mqtt")]
mod mqtt_binary {
    publisher_conformance_tests!(
        crate::publisher_conformance::mqtt::MqttHarness<{ crate::publisher_conformance::CE }>
    );
}

#[cfg(feature = "mqtt")]
mod mqtt_structured {
    publisher_conformance_tests!(
        crate::publisher_conformance::mqtt::MqttHarness<
            { crate::publisher_conformance::CE_STRUCTURED },
        >
    );
}
