//! The sinks against their real brokers: the sink contract as one suite
//! ([`publisher_conformance`], a harness per sink) instantiated once per sink and envelope
//! in `conformance`; each sink's own checks (`sink_<name>`), error classification, control
//! topics, TLS and authentication, the CloudEvents envelope read by the official SDK
//! (`cloudevents`, `cloudevents_sdk.py`), and the relay against destinations that are
//! routed, slow, silent after the request, or down (`routing`, `slow_destinations`,
//! `timeout_after_send`, `broker_outage`, `rabbitmq_outage`).

// Before `conformance`, whose modules call its `publisher_conformance_tests!`.
#[macro_use]
pub(crate) mod publisher_conformance;

mod broker_outage;
pub(crate) mod cloudevents;
mod conformance;
mod control_topics;
pub(crate) mod rabbitmq_outage;
mod routing;
mod sink_classification;
pub(crate) mod sink_http;
mod sink_kafka;
mod sink_mqtt;
mod sink_rabbitmq;
mod sink_redis;
mod sink_sidekiq;
mod slow_destinations;
mod timeout_after_send;
pub(crate) mod tls;
