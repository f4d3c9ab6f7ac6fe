//! The publisher conformance suite (`sink/publisher_conformance/mod.rs`) instantiated once
//! per sink against its real server, a module per sink: `file` (its `local` cases: there is
//! no broker to be down and no topic it refuses), `http`, `kafka`, `mqtt`, `nats`,
//! `rabbitmq`, `redis`, and `router`, the `Router` as a sink (two routes to two file sinks;
//! a route to a stopped NATS server for the broker-down case, a topic no route matches for
//! the permanent one).
//!
//! `cloudevents` runs the suite again with the CloudEvents envelope
//! (`envelope=cloudevents`), once per sink and content mode: every case reads the messages
//! back through the same `outbox::envelope::from_*` decoders, which must give the same
//! envelope as the outbox envelope does (message id, topic, key, occurred-at, every header,
//! payload bytes). Kafka's CloudEvents cases are in `kafka` rather than there: the Kafka
//! tests run in a step of their own, selected by the `kafka` module's path.

#![allow(clippy::unwrap_used)]

mod file {
    publisher_conformance_tests!(crate::sink::publisher_conformance::file::FileHarness, local);
}

#[cfg(feature = "http")]
mod http {
    publisher_conformance_tests!(crate::sink::publisher_conformance::http::HttpHarness);
}

#[cfg(feature = "kafka")]
mod kafka {
    publisher_conformance_tests!(crate::sink::publisher_conformance::kafka::KafkaHarness);

    mod cloudevents_binary {
        publisher_conformance_tests!(
            crate::sink::publisher_conformance::kafka::KafkaHarness<
                { crate::sink::publisher_conformance::CE },
            >
        );
    }

    mod cloudevents_structured {
        publisher_conformance_tests!(
            crate::sink::publisher_conformance::kafka::KafkaHarness<
                { crate::sink::publisher_conformance::CE_STRUCTURED },
            >
        );
    }
}

#[cfg(feature = "mqtt")]
mod mqtt {
    publisher_conformance_tests!(crate::sink::publisher_conformance::mqtt::MqttHarness);
}

#[cfg(feature = "nats")]
mod nats {
    publisher_conformance_tests!(crate::sink::publisher_conformance::nats::NatsHarness);
}

#[cfg(feature = "rabbitmq")]
mod rabbitmq {
    publisher_conformance_tests!(crate::sink::publisher_conformance::rabbitmq::RabbitMqHarness);
}

#[cfg(feature = "redis")]
mod redis {
    publisher_conformance_tests!(crate::sink::publisher_conformance::redis::RedisHarness);
}

#[cfg(feature = "nats")]
mod router {
    publisher_conformance_tests!(crate::sink::publisher_conformance::router::RouterHarness);
}

/// The CloudEvents envelope, once per sink and content mode (Kafka's: in `kafka`).
mod cloudevents {
    #[cfg(feature = "http")]
    mod http_binary {
        publisher_conformance_tests!(
            crate::sink::publisher_conformance::http::HttpHarness<
                { crate::sink::publisher_conformance::CE },
            >
        );
    }

    #[cfg(feature = "http")]
    mod http_structured {
        publisher_conformance_tests!(
            crate::sink::publisher_conformance::http::HttpHarness<
                { crate::sink::publisher_conformance::CE_STRUCTURED },
            >
        );
    }

    /// NATS: structured mode, the only one of the binding.
    #[cfg(feature = "nats")]
    mod nats_structured {
        publisher_conformance_tests!(
            crate::sink::publisher_conformance::nats::NatsHarness<
                { crate::sink::publisher_conformance::CE },
            >
        );
    }

    #[cfg(feature = "rabbitmq")]
    mod rabbitmq_binary {
        publisher_conformance_tests!(
            crate::sink::publisher_conformance::rabbitmq::RabbitMqHarness<
                { crate::sink::publisher_conformance::CE },
            >
        );
    }

    #[cfg(feature = "rabbitmq")]
    mod rabbitmq_structured {
        publisher_conformance_tests!(
            crate::sink::publisher_conformance::rabbitmq::RabbitMqHarness<
                { crate::sink::publisher_conformance::CE_STRUCTURED },
            >
        );
    }

    #[cfg(feature = "mqtt")]
    mod mqtt_binary {
        publisher_conformance_tests!(
            crate::sink::publisher_conformance::mqtt::MqttHarness<
                { crate::sink::publisher_conformance::CE },
            >
        );
    }

    #[cfg(feature = "mqtt")]
    mod mqtt_structured {
        publisher_conformance_tests!(
            crate::sink::publisher_conformance::mqtt::MqttHarness<
                { crate::sink::publisher_conformance::CE_STRUCTURED },
            >
        );
    }
}
