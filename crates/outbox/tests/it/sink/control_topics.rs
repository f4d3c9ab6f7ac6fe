//! Topics that address a broker's control plane are refused by the sinks, permanently and
//! before anything is sent: NATS `$…` and `_INBOX.` subjects (a `$JS.API.STREAM.DELETE.…`
//! topic must not delete a stream), RabbitMQ `amq.` queue names on the default exchange,
//! Redis keys with glob or control characters, MQTT `$` topics. Each refused message is a
//! dead letter whose reason names the control topic (code `control_topic`, or
//! `invalid_topic` for a character rule), also while the broker is down; the rest of the
//! batch still goes. Kafka's rule is unit-tested in `sink::kafka` (feature `kafka`).

#![allow(clippy::unwrap_used)]

use crate::common::unique;
use crate::sink::publisher_conformance::{closed_port, outgoing};
use outbox::sink::{CONTROL_TOPIC, ErrorKind, PublishError, Sink};
use std::time::Duration;

/// Asserts that `r` is a permanent refusal with `code` whose reason names `topic`.
fn assert_refused(r: &Result<(), PublishError>, topic: &str, code: &str) {
    let e = r
        .clone()
        .expect_err(&format!("{topic:?} must be refused, got Ok"));
    assert_eq!(e.kind, ErrorKind::Permanent, "{topic:?}: {e}");
    assert_eq!(e.code, code, "{topic:?}: {e}");
    assert!(
        e.message.contains(&format!("{topic:?}")),
        "the reason names the topic {topic:?}: {e}"
    );
}

#[cfg(all(feature = "nats", feature = "postgres"))]
mod nats {
    use super::*;
    use crate::common::{nats_connect, nats_url, relay_config, wait_until};
    use crate::store::conformance::Backend as _;
    use crate::store::conformance_postgres::PgBackend;
    use futures::StreamExt as _;
    use outbox::sink::nats::{NatsOptions, NatsSink};
    use outbox::{Message, Relay};

    /// A stream `CT_<u>` over `ct<u>.>`, deleted (best effort) when dropped.
    struct Stream {
        name: String,
        prefix: String,
        js: async_nats::jetstream::Context,
    }

    impl Stream {
        async fn create(client: &async_nats::Client) -> Self {
            let u = unique();
            let name = format!("CT_{u}");
            let prefix = format!("ct{u}");
            let js = async_nats::jetstream::new(client.clone());
            js.create_stream(async_nats::jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![format!("{prefix}.>")],
                storage: async_nats::jetstream::stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .unwrap();
            Stream { name, prefix, js }
        }

        async fn exists(&self) -> bool {
            self.js.get_stream(&self.name).await.is_ok()
        }

        async fn messages(&self) -> u64 {
            let mut s = self.js.get_stream(&self.name).await.unwrap();
            s.info().await.unwrap().state.messages
        }
    }

    impl Drop for Stream {
        fn drop(&mut self) {
            let (js, name) = (self.js.clone(), self.name.clone());
            crate::common::cleanup_blocking(async move {
                let _ = js.delete_stream(&name).await;
            });
        }
    }

    async fn sink(url: &str) -> NatsSink {
        NatsSink::connect(
            url,
            NatsOptions {
                ack_timeout: Duration::from_secs(2),
            },
        )
        .await
        .unwrap()
    }

    /// A producer enqueues `$JS.API.STREAM.DELETE.<stream>`: the relay quarantines it at
    /// once with a reason naming the control topic, the stream survives and the message
    /// beside it is delivered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_jetstream_api_subject_is_a_dead_letter_and_the_stream_survives() {
        let client = nats_connect().await;
        let stream = Stream::create(&client).await;
        let db = PgBackend::create("ctnats", outbox::store::DEFAULT_MAX_MESSAGE_BYTES).await;
        let delete = format!("$JS.API.STREAM.DELETE.{}", stream.name);
        let msgs = vec![
            Message::new(delete.clone(), b"{}".to_vec()),
            Message::new(format!("{}.ok", stream.prefix), b"ok".to_vec()),
        ];
        let enq = db.enqueue_all(&msgs).await;

        let mut cfg = relay_config("ctnats");
        cfg.max_attempts = 2;
        let handle = Relay::new(
            db.store(),
            std::sync::Arc::new(sink(&nats_url()).await),
            cfg,
        )
        .spawn();
        let store = db.store();
        wait_until(
            "nothing pending or claimed",
            Duration::from_secs(20),
            || {
                let s = store.clone();
                async move {
                    let c = s.counts().await.unwrap();
                    if c.pending == 0 && c.claimed == 0 {
                        Ok(())
                    } else {
                        Err(format!("{c:?}"))
                    }
                }
            },
        )
        .await;
        handle.shutdown().await.unwrap();

        assert!(
            stream.exists().await,
            "stream {} was deleted through the topic {delete:?}",
            stream.name
        );
        let dead = db.row(enq[0].id).await;
        assert_eq!(
            (dead.status, dead.attempts),
            (3, 1),
            "dead at the first attempt: {dead:?}"
        );
        let reason = dead.last_error.unwrap_or_default();
        assert!(
            reason.contains("control topic") && reason.contains(&delete),
            "{reason}"
        );
        assert_eq!(db.row(enq[1].id).await.status, 2, "the other message went");
        assert_eq!(stream.messages().await, 1);
    }

    /// Every `$` subject and `_INBOX.` is refused with `control_topic`; a subscriber on
    /// one of them receives nothing, and the valid message of the batch is stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dollar_and_inbox_subjects_are_refused_before_sending() {
        let client = nats_connect().await;
        let stream = Stream::create(&client).await;
        let u = unique();
        let watched = format!("$KV.ct{u}.key");
        let mut sub = client.subscribe(watched.clone()).await.unwrap();
        let sentinel = format!("ct{u}.sentinel");
        let mut sentinel_sub = client.subscribe(sentinel.clone()).await.unwrap();
        client.flush().await.unwrap();

        let topics = [
            format!("$JS.API.STREAM.DELETE.{}", stream.name),
            format!("$JS.API.STREAM.CREATE.CT_{u}"),
            "$JS.API.INFO".to_owned(),
            "$SYS.REQ.SERVER.PING".to_owned(),
            watched.clone(),
            format!("$O.ct{u}.chunk"),
            format!("$MQTT.sess.ct{u}"),
            format!("$JSC.R.ct{u}"),
            "$G".to_owned(),
            format!("_INBOX.ct{u}.reply"),
        ];
        let sink = sink(&nats_url()).await;
        let mut batch: Vec<_> = topics
            .iter()
            .enumerate()
            .map(|(i, t)| outgoing(i as i64, t, None, b"{}".to_vec()))
            .collect();
        batch.push(outgoing(
            99,
            &format!("{}.ok", stream.prefix),
            None,
            b"ok".to_vec(),
        ));
        let r = sink.publish_all(&batch).await;
        for (t, r) in topics.iter().zip(&r) {
            assert_refused(r, t, CONTROL_TOPIC);
        }
        assert_eq!(r[topics.len()], Ok(()));
        // Sent after the batch on the sink's own connection: once it arrives, anything the
        // batch had sent to the watched subject would have arrived before it.
        sink.client().publish(sentinel, "s".into()).await.unwrap();
        sink.client().flush().await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), sentinel_sub.next())
            .await
            .unwrap()
            .unwrap();
        assert!(
            futures::FutureExt::now_or_never(sub.next()).is_none(),
            "a message reached {watched}"
        );
        assert!(stream.exists().await);
        assert_eq!(stream.messages().await, 1);
        sink.close().await;
    }

    /// The refusal needs no broker: with the server down, control subjects are permanent
    /// (dead letters) while the valid message is only unavailable (its attempt given back).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused_while_the_server_is_down() {
        let sink = sink(&format!("nats://127.0.0.1:{}", closed_port())).await;
        let batch = [
            outgoing(1, "$JS.API.STREAM.DELETE.ORDERS", None, b"{}".to_vec()),
            outgoing(2, "orders.placed", None, b"{}".to_vec()),
        ];
        let r = sink.publish_all(&batch).await;
        assert_refused(&r[0], "$JS.API.STREAM.DELETE.ORDERS", CONTROL_TOPIC);
        assert_eq!(r[1].clone().unwrap_err().kind, ErrorKind::Unavailable);
        sink.close().await;
    }
}

#[cfg(feature = "rabbitmq")]
mod rabbitmq {
    use super::*;
    use crate::sink::publisher_conformance::rabbitmq::{admin, amqp_url};
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;
    use outbox::sink::rabbitmq::RabbitMqSink;

    /// On the default exchange the routing key names a queue: a server-named queue
    /// (`amq.gen-…`, another client's exclusive reply queue) and the direct reply-to
    /// pseudo-queue cannot be addressed; an ordinary queue still can.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn amq_queues_cannot_be_addressed_through_the_default_exchange() {
        let (_conn, ch) = admin().await;
        let private = ch
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let private = private.name().as_str().to_owned();
        assert!(private.starts_with("amq."), "{private}");
        let plain = format!("outbox.ct.{}", unique());
        ch.queue_declare(
            plain.as_str().into(),
            QueueDeclareOptions {
                auto_delete: false,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();

        let sink = RabbitMqSink::connect(&amqp_url()).await.unwrap();
        let topics = [
            private.clone(),
            "amq.rabbitmq.reply-to".to_owned(),
            "amq.rabbitmq.reply-to.g1h2AA5yZXBseUAxAAAA".to_owned(),
        ];
        let mut batch: Vec<_> = topics
            .iter()
            .enumerate()
            .map(|(i, t)| outgoing(i as i64, t, None, b"x".to_vec()))
            .collect();
        batch.push(outgoing(9, &plain, None, b"ok".to_vec()));
        let r = sink.publish_all(&batch).await;
        for (t, r) in topics.iter().zip(&r) {
            assert_refused(r, t, CONTROL_TOPIC);
        }
        assert_eq!(r[topics.len()], Ok(()));
        let count = |q: String| {
            let ch = ch.clone();
            async move {
                ch.queue_declare(
                    q.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap()
                .message_count()
            }
        };
        assert_eq!(
            count(private.clone()).await,
            0,
            "a message reached {private}"
        );
        assert_eq!(count(plain.clone()).await, 1);
        sink.close().await;
        let _ = ch
            .queue_delete(plain.as_str().into(), QueueDeleteOptions::default())
            .await;
    }

    /// The refusal needs no broker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused_while_the_broker_is_down() {
        let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port());
        let sink = RabbitMqSink::connect(&url).await.unwrap();
        let r = sink
            .publish_all(&[
                outgoing(1, "amq.gen-abc", None, b"x".to_vec()),
                outgoing(2, "orders", None, b"x".to_vec()),
            ])
            .await;
        assert_refused(&r[0], "amq.gen-abc", CONTROL_TOPIC);
        assert_eq!(r[1].clone().unwrap_err().kind, ErrorKind::Unavailable);
        sink.close().await;
    }
}

#[cfg(feature = "redis")]
mod redis_streams {
    use super::*;
    use crate::sink::publisher_conformance::redis::{admin, redis_url};
    use outbox::sink::redis_streams::RedisStreamsSink;
    use redis::AsyncCommands as _;

    /// Keys with glob characters (what `KEYS`, `SCAN MATCH`, `PSUBSCRIBE` and ACL key
    /// patterns read as patterns) or control characters are refused and never written; a
    /// plain key in the same batch is.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn glob_and_control_characters_are_refused() {
        let mut admin = admin().await;
        let prefix = format!("outbox.ct.{}", unique());
        let bad = [
            format!("{prefix}.*"),
            format!("{prefix}.a?b"),
            format!("{prefix}.[ab]"),
            format!("{prefix}.a\\b"),
            format!("{prefix}.a\nb"),
            format!("{prefix}.a\u{7f}b"),
        ];
        let ok = format!("{prefix}.ok");
        let sink = RedisStreamsSink::connect(&redis_url()).await.unwrap();
        let mut batch: Vec<_> = bad
            .iter()
            .enumerate()
            .map(|(i, t)| outgoing(i as i64, t, None, b"x".to_vec()))
            .collect();
        batch.push(outgoing(9, &ok, None, b"ok".to_vec()));
        let r = sink.publish_all(&batch).await;
        let mut written = Vec::new();
        for k in bad.iter().chain([&ok]) {
            let n: i64 = admin.exists(k).await.unwrap();
            if n > 0 {
                written.push(k.clone());
            }
        }
        let _: redis::RedisResult<()> = admin.del(bad.to_vec()).await;
        let _: redis::RedisResult<()> = admin.del(&ok).await;
        for (t, r) in bad.iter().zip(&r) {
            assert_refused(r, t, "invalid_topic");
        }
        assert_eq!(r[bad.len()], Ok(()));
        assert_eq!(written, vec![ok], "only the plain key is written");
        sink.close().await;
    }

    /// The refusal needs no server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused_while_the_server_is_down() {
        let url = format!("redis://127.0.0.1:{}", closed_port());
        let sink = RedisStreamsSink::connect(&url).await.unwrap();
        let r = sink
            .publish_all(&[
                outgoing(1, "orders.*", None, b"x".to_vec()),
                outgoing(2, "orders", None, b"x".to_vec()),
            ])
            .await;
        assert_refused(&r[0], "orders.*", "invalid_topic");
        assert_eq!(r[1].clone().unwrap_err().kind, ErrorKind::Unavailable);
        sink.close().await;
    }
}

#[cfg(feature = "mqtt")]
mod mqtt {
    use super::*;
    use crate::sink::publisher_conformance::mqtt::require_broker;
    use outbox::sink::mqtt::MqttSink;

    /// `$` topics (`$SYS/…`, `$share/…`) are the broker's: refused as control topics.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dollar_topics_are_control_topics() {
        let url = require_broker().await;
        let sink = MqttSink::connect(&url).await.unwrap();
        let topics = ["$SYS/broker/clients", "$share/g/orders", "$ct"];
        let batch: Vec<_> = topics
            .iter()
            .enumerate()
            .map(|(i, t)| outgoing(i as i64, t, None, b"x".to_vec()))
            .collect();
        let r = sink.publish_all(&batch).await;
        for (t, r) in topics.iter().zip(&r) {
            assert_refused(r, t, CONTROL_TOPIC);
        }
        sink.close().await;
    }

    /// The refusal needs no broker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused_while_the_broker_is_down() {
        let url = format!("mqtt://127.0.0.1:{}", closed_port());
        let sink = MqttSink::connect(&url).await.unwrap();
        let r = sink
            .publish_all(&[
                outgoing(1, "$SYS/x", None, b"x".to_vec()),
                outgoing(2, "orders", None, b"x".to_vec()),
            ])
            .await;
        assert_refused(&r[0], "$SYS/x", CONTROL_TOPIC);
        assert_eq!(r[1].clone().unwrap_err().kind, ErrorKind::Unavailable);
        sink.close().await;
    }
}

#[cfg(feature = "http")]
mod http {
    use super::*;
    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode, Uri};
    use outbox::sink::http::WebhookSink;
    use std::sync::{Arc, Mutex};

    type Requests = Arc<Mutex<Vec<(String, Option<String>)>>>;

    async fn record(State(reqs): State<Requests>, uri: Uri, headers: HeaderMap) -> StatusCode {
        let topic = headers
            .get("topic")
            .map(|v| crate::sink::publisher_conformance::http::percent_decode(v.to_str().unwrap()));
        reqs.lock().unwrap().push((uri.to_string(), topic));
        StatusCode::NO_CONTENT
    }

    /// A topic never changes where a webhook goes: every request reaches the configured
    /// path and query, and the topic arrives, intact, only in its header.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_topic_never_changes_the_webhook_url() {
        let requests: Requests = Arc::default();
        let app = axum::Router::new()
            .fallback(record)
            .with_state(requests.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        let sink = WebhookSink::connect(&format!("http://{addr}/hooks/orders?sig=1"))
            .await
            .unwrap();
        let topics = [
            "../admin",
            "orders?x=1#frag",
            "@evil.example/x",
            "%2e%2e/%2fadmin",
            "a\r\nHost: evil.example",
        ];
        let batch: Vec<_> = topics
            .iter()
            .enumerate()
            .map(|(i, t)| outgoing(i as i64, t, None, b"x".to_vec()))
            .collect();
        let r = sink.publish_all(&batch).await;
        assert!(r.iter().all(Result::is_ok), "{r:?}");
        // The requests run concurrently: compare them as sets.
        let got = requests.lock().unwrap().clone();
        let mut arrived: Vec<String> = got
            .iter()
            .map(|(uri, topic)| {
                assert_eq!(uri, "/hooks/orders?sig=1", "{topic:?}");
                topic.clone().unwrap_or_default()
            })
            .collect();
        arrived.sort();
        let mut sent: Vec<String> = topics.iter().map(|t| (*t).to_owned()).collect();
        sent.sort();
        assert_eq!(arrived, sent);
        server.abort();
    }
}
