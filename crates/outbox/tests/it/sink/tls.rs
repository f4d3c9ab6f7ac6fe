//! Every network sink over TLS with authentication, against private servers this module
//! starts on loopback with a throwaway CA (rcgen): NATS (TLS + mutual TLS + user/password
//! and NKey), Redis (`--tls-port` + an ACL user), Mosquitto (TLS listener + client
//! certificates + a password file), RabbitMQ (an `amqps` listener + a user) and an HTTPS
//! endpoint (client certificates + a bearer token). Each checks delivery, and the clear
//! error at start for an untrusted server certificate, wrong credentials and a plain-text
//! URL to a TLS-only port.

#![allow(clippy::unwrap_used)]

use crate::common::{free_port, nats_server_bin};
use crate::sink::publisher_conformance::outgoing;
use outbox::Sink;
use outbox::sink::SinkError;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const USER: &str = "app";
const PASSWORD: &str = "s3cret-TLS-pw";

/// A throwaway PKI in a directory every server can read: a CA, a server certificate for
/// `localhost` and `127.0.0.1`, a client certificate (common name and DNS name
/// `outbox-relay`, which a database can take as the user name), and a second CA nobody
/// uses. Shared with `store_tls.rs`.
pub(crate) struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    pub(crate) fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ca = |name: &str| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(DnType::CommonName, format!("outbox test {name}"));
            params.key_usages = vec![
                KeyUsagePurpose::KeyCertSign,
                KeyUsagePurpose::CrlSign,
                KeyUsagePurpose::DigitalSignature,
            ];
            let cert = params.self_signed(&key).unwrap();
            (cert.pem(), Issuer::new(params, key))
        };
        let (ca_pem, issuer) = ca("CA");
        let (other_pem, _) = ca("other CA");
        std::fs::write(d.join("ca.pem"), ca_pem).unwrap();
        std::fs::write(d.join("other-ca.pem"), other_pem).unwrap();
        let leaf = |cn: &str, names: Vec<String>, purpose: ExtendedKeyUsagePurpose, file: &str| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(names).unwrap();
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = vec![purpose];
            let cert = params.signed_by(&key, &issuer).unwrap();
            std::fs::write(d.join(format!("{file}.pem")), cert.pem()).unwrap();
            std::fs::write(d.join(format!("{file}.key")), key.serialize_pem()).unwrap();
        };
        leaf(
            "outbox test server",
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
            "server",
        );
        leaf(
            "outbox-relay",
            vec!["outbox-relay".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
            "client",
        );
        // Servers drop privileges (RabbitMQ, Mosquitto): let them read the files.
        for entry in std::fs::read_dir(d).unwrap() {
            let _ = Command::new("chmod")
                .arg("644")
                .arg(entry.unwrap().path())
                .status();
        }
        let _ = Command::new("chmod").arg("755").arg(d).status();
        Pki { dir }
    }

    pub(crate) fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    pub(crate) fn show(&self, file: &str) -> String {
        self.path(file).display().to_string()
    }

    /// The query parameters for this PKI: our CA, and the client identity.
    fn params(&self) -> String {
        format!(
            "ca={}&cert={}&key={}",
            self.show("ca.pem"),
            self.show("client.pem"),
            self.show("client.key")
        )
    }

    /// As [`Pki::params`] with the CA nobody signed the server with.
    fn wrong_ca_params(&self) -> String {
        format!(
            "ca={}&cert={}&key={}",
            self.show("other-ca.pem"),
            self.show("client.pem"),
            self.show("client.key")
        )
    }
}

/// A server process of the test's own, killed when dropped. Shared with `store_tls.rs`.
pub(crate) struct Server {
    child: Child,
    what: &'static str,
    log: PathBuf,
}

impl Server {
    pub(crate) fn spawn(what: &'static str, mut cmd: Command, log: PathBuf) -> Self {
        let out = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {what} ({e}); install it from Debian's packages")
            });
        Server { child, what, log }
    }

    pub(crate) async fn wait_port(&mut self, port: u16) {
        let what = format!("private {} to listen on {port}", self.what);
        crate::common::wait_until(&what, Duration::from_secs(15), || {
            self.assert_running();
            let log = self.log.clone();
            async move {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .map(drop)
                    .map_err(|e| {
                        let log = std::fs::read_to_string(&log).unwrap_or_default();
                        format!("{e}; log:\n{log}")
                    })
            }
        })
        .await;
    }

    /// Panics with the server's log unless it is still running.
    pub(crate) fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "private {} exited with {status}; log:\n{}",
                self.what,
                self.log()
            );
        }
    }

    /// The server's output so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Asks the server to shut down with `signal` (a database cleans up after itself: its
    /// shared memory, its socket) and waits up to 10 s for it; the drop kills it after that.
    pub(crate) fn stop(&mut self, signal: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The error `open` gave, as text; panics when it opened.
async fn open_error(url: &str) -> String {
    match outbox::sink::open(url).await {
        Ok(sink) => panic!("{} opened, expected an error", sink.describe()),
        Err(e) => {
            let text = format!(
                "{e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            );
            assert!(!text.contains(PASSWORD), "the password leaked into {text}");
            text
        }
    }
}

async fn deliver(url: &str, topic: &str, n: i64) -> Box<dyn Sink> {
    let sink = outbox::sink::open(url)
        .await
        .unwrap_or_else(|e| panic!("open {url}: {e} ({:?})", std::error::Error::source(&e)));
    assert!(
        !sink.describe().contains(PASSWORD),
        "the password leaked into {}",
        sink.describe()
    );
    let batch: Vec<_> = (1..=n)
        .map(|i| outgoing(i, topic, Some("k"), format!("tls {i}").into_bytes()))
        .collect();
    for (i, r) in sink.publish_all(&batch).await.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("message {i} over {}: {e}", sink.describe()));
    }
    sink
}

// ---------------------------------------------------------------------------------------
// NATS

async fn nats_server(pki: &Pki) -> (Server, u16, nkeys::KeyPair) {
    let port = free_port();
    let nkey = nkeys::KeyPair::new_user();
    let store = pki.path("js");
    let conf = format!(
        r#"listen: "127.0.0.1:{port}"
jetstream {{ store_dir: "{store}" }}
tls {{
  cert_file: "{cert}"
  key_file: "{key}"
  ca_file: "{ca}"
  verify: true
  timeout: 2
}}
authorization {{
  users = [
    {{ user: "{USER}", password: "{PASSWORD}" }}
    {{ nkey: "{public}" }}
  ]
}}
"#,
        store = store.display(),
        cert = pki.show("server.pem"),
        key = pki.show("server.key"),
        ca = pki.show("ca.pem"),
        public = nkey.public_key(),
    );
    std::fs::write(pki.path("nats.conf"), conf).unwrap();
    let mut cmd = Command::new(nats_server_bin());
    cmd.arg("-c").arg(pki.path("nats.conf"));
    let mut server = Server::spawn("nats-server", cmd, pki.path("nats.log"));
    server.wait_port(port).await;
    (server, port, nkey)
}

#[tokio::test]
async fn nats_over_tls_with_client_certificates_password_and_nkey() {
    let pki = Pki::new();
    let (_server, port, nkey) = nats_server(&pki).await;
    // A stream to publish into, made over the same TLS with the user's password.
    let admin = async_nats::ConnectOptions::new()
        .user_and_password(USER.into(), PASSWORD.into())
        .add_root_certificates(pki.path("ca.pem"))
        .add_client_certificate(pki.path("client.pem"), pki.path("client.key"))
        .require_tls(true)
        .connect(format!("tls://127.0.0.1:{port}"))
        .await
        .unwrap();
    let js = async_nats::jetstream::new(admin);
    let mut stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "TLS".into(),
            subjects: vec!["tls.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();

    // tls:// with user and password.
    deliver(
        &format!("tls://{USER}:{PASSWORD}@127.0.0.1:{port}?{}", pki.params()),
        "tls.password",
        3,
    )
    .await;
    // nats:// to a server that requires TLS upgrades; the password from a file.
    std::fs::write(pki.path("nats-pw"), format!("{PASSWORD}\n")).unwrap();
    deliver(
        &format!(
            "nats://{USER}@127.0.0.1:{port}?{}&password_file={}",
            pki.params(),
            pki.show("nats-pw")
        ),
        "tls.password-file",
        2,
    )
    .await;
    // An NKey seed from a file.
    std::fs::write(pki.path("seed.nk"), nkey.seed().unwrap()).unwrap();
    deliver(
        &format!(
            "tls://127.0.0.1:{port}?{}&nkey={}",
            pki.params(),
            pki.show("seed.nk")
        ),
        "tls.nkey",
        4,
    )
    .await;
    assert_eq!(stream.info().await.unwrap().state.messages, 9);

    // The clear errors at start.
    let e = open_error(&format!(
        "tls://{USER}:{PASSWORD}@127.0.0.1:{port}?{}",
        pki.wrong_ca_params()
    ))
    .await;
    assert!(
        e.contains("TLS handshake with 127.0.0.1")
            && e.contains("UnknownIssuer")
            && e.contains("other-ca.pem"),
        "{e}"
    );
    let e = open_error(&format!(
        "tls://{USER}:wrong-password@127.0.0.1:{port}?{}",
        pki.params()
    ))
    .await;
    assert!(e.contains("refused the credentials"), "{e}");
    let e = open_error(&format!(
        "tls://{USER}:{PASSWORD}@127.0.0.1:{port}?ca={}&cert={}",
        pki.show("ca.pem"),
        pki.show("client.pem")
    ))
    .await;
    assert!(e.contains("cert= and key= go together"), "{e}");
    let e = open_error(&format!(
        "tls://127.0.0.1:{port}?{}&nkey={}",
        pki.params(),
        pki.show("nats-pw")
    ))
    .await;
    assert!(e.contains("does not hold an NKey seed"), "{e}");
}

// ---------------------------------------------------------------------------------------
// Redis

#[tokio::test]
async fn redis_over_tls_with_an_acl_user() {
    let pki = Pki::new();
    let port = free_port();
    let mut cmd = Command::new("redis-server");
    cmd.args([
        "--port",
        "0",
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ])
    .args(["--tls-port", &port.to_string()])
    .arg("--tls-cert-file")
    .arg(pki.path("server.pem"))
    .arg("--tls-key-file")
    .arg(pki.path("server.key"))
    .arg("--tls-ca-cert-file")
    .arg(pki.path("ca.pem"))
    .args(["--tls-auth-clients", "yes"])
    .arg("--dir")
    .arg(pki.path(""))
    .args(["--user", "default", "off"])
    .args(["--user", USER, "on", &format!(">{PASSWORD}"), "~*", "+@all"]);
    let mut server = Server::spawn("redis-server", cmd, pki.path("redis.log"));
    server.wait_port(port).await;

    deliver(
        &format!(
            "rediss://{USER}:{PASSWORD}@127.0.0.1:{port}?{}",
            pki.params()
        ),
        "tls.redis",
        5,
    )
    .await;
    std::fs::write(pki.path("redis-pw"), PASSWORD).unwrap();
    deliver(
        &format!(
            "rediss://{USER}@127.0.0.1:{port}?{}&password_file={}&maxlen=100",
            pki.params(),
            pki.show("redis-pw")
        ),
        "tls.redis",
        2,
    )
    .await;
    // Read back over the same TLS: seven entries.
    let client = redis::Client::build_with_tls(
        format!("rediss://{USER}:{PASSWORD}@127.0.0.1:{port}"),
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: std::fs::read(pki.path("client.pem")).unwrap(),
                client_key: std::fs::read(pki.path("client.key")).unwrap(),
            }),
            root_cert: Some(std::fs::read(pki.path("ca.pem")).unwrap()),
        },
    )
    .unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let len: u64 = redis::cmd("XLEN")
        .arg("tls.redis")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(len, 7);

    // The Sidekiq sink reaches the same server the same ways: TLS, client certificate,
    // ACL user, password file.
    deliver(
        &format!(
            "sidekiqs://{USER}@127.0.0.1:{port}?{}&password_file={}&class=TlsJob&queue=tls",
            pki.params(),
            pki.show("redis-pw")
        ),
        "tls.sidekiq",
        3,
    )
    .await;
    let jobs: u64 = redis::cmd("LLEN")
        .arg("queue:tls")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(jobs, 3);
    let e = open_error(&format!(
        "sidekiq://{USER}:{PASSWORD}@127.0.0.1:{port}?class=TlsJob"
    ))
    .await;
    assert!(e.contains("speaks TLS: use sidekiqs://"), "{e}");

    let e = open_error(&format!(
        "rediss://{USER}:{PASSWORD}@127.0.0.1:{port}?{}",
        pki.wrong_ca_params()
    ))
    .await;
    assert!(
        e.contains("UnknownIssuer") && e.contains(&format!("127.0.0.1:{port}")),
        "{e}"
    );
    let e = open_error(&format!(
        "rediss://{USER}:wrong-password@127.0.0.1:{port}?{}",
        pki.params()
    ))
    .await;
    assert!(e.contains("refused the credentials"), "{e}");
    let e = open_error(&format!("redis://{USER}:{PASSWORD}@127.0.0.1:{port}")).await;
    assert!(e.contains("speaks TLS: use rediss://"), "{e}");
    // No credentials at all, where the server requires them.
    let e = open_error(&format!("rediss://127.0.0.1:{port}?{}", pki.params())).await;
    assert!(e.contains("requires credentials"), "{e}");
}

// ---------------------------------------------------------------------------------------
// MQTT (Mosquitto)

#[tokio::test]
async fn mqtt_over_tls_with_client_certificates_and_a_password_file() {
    let pki = Pki::new();
    let port = free_port();
    let passwd = pki.path("mosquitto.passwd");
    let ok = Command::new("mosquitto_passwd")
        .args(["-b", "-c"])
        .arg(&passwd)
        .args([USER, PASSWORD])
        .status()
        .expect("mosquitto_passwd (Debian's mosquitto package)")
        .success();
    assert!(ok);
    let _ = Command::new("chmod").arg("644").arg(&passwd).status();
    std::fs::write(
        pki.path("mosquitto.conf"),
        format!(
            "listener {port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\nrequire_certificate true\n\
             allow_anonymous false\npassword_file {}\npersistence false\n",
            pki.show("ca.pem"),
            pki.show("server.pem"),
            pki.show("server.key"),
            passwd.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new("mosquitto");
    cmd.arg("-c").arg(pki.path("mosquitto.conf"));
    let mut server = Server::spawn("mosquitto", cmd, pki.path("mosquitto.log"));
    server.wait_port(port).await;

    deliver(
        &format!(
            "mqtts://{USER}:{PASSWORD}@127.0.0.1:{port}?{}",
            pki.params()
        ),
        "tls/mqtt",
        5,
    )
    .await;
    std::fs::write(pki.path("mqtt-pw"), PASSWORD).unwrap();
    deliver(
        &format!(
            "mqtts://{USER}@127.0.0.1:{port}?{}&password_file={}&qos=2",
            pki.params(),
            pki.show("mqtt-pw")
        ),
        "tls/mqtt",
        3,
    )
    .await;

    let e = open_error(&format!(
        "mqtts://{USER}:{PASSWORD}@127.0.0.1:{port}?{}",
        pki.wrong_ca_params()
    ))
    .await;
    assert!(e.contains("UnknownIssuer"), "{e}");
    let e = open_error(&format!(
        "mqtts://{USER}:wrong-password@127.0.0.1:{port}?{}",
        pki.params()
    ))
    .await;
    assert!(e.contains("refused the connection"), "{e}");
    let e = open_error(&format!("mqtt://{USER}:{PASSWORD}@127.0.0.1:{port}")).await;
    assert!(e.contains("speaks TLS: use mqtts://"), "{e}");
    let e = open_error(&format!("mqtt://127.0.0.1:{port}?{}", pki.params())).await;
    assert!(e.contains("need an mqtts:// URL"), "{e}");
}

// ---------------------------------------------------------------------------------------
// RabbitMQ

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_over_amqps_with_a_user_and_client_certificates() {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let pki = Pki::new();
    let tls_port = free_port();
    let node = crate::sink::rabbitmq_outage::Node::start_with(
        |dir| {
            for f in ["ca.pem", "server.pem", "server.key"] {
                std::fs::copy(pki.path(f), dir.join(f)).unwrap();
            }
            format!(
                "listeners.ssl.default = 127.0.0.1:{tls_port}\n\
                 ssl_options.cacertfile = {ca}\nssl_options.certfile = {cert}\n\
                 ssl_options.keyfile = {key}\nssl_options.verify = verify_peer\n\
                 ssl_options.fail_if_no_peer_cert = true\n",
                ca = dir.join("ca.pem").display(),
                cert = dir.join("server.pem").display(),
                key = dir.join("server.key").display(),
            )
        },
        (USER, PASSWORD),
    )
    .await;
    // The queue the default exchange routes the topic to (declared over the plain port).
    let conn = lapin::Connection::connect(&node.url(), lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "tls.rabbitmq".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();

    deliver(
        &format!(
            "amqps://{USER}:{PASSWORD}@127.0.0.1:{tls_port}/%2f?{}",
            pki.params()
        ),
        "tls.rabbitmq",
        5,
    )
    .await;
    std::fs::write(pki.path("amqp-pw"), PASSWORD).unwrap();
    deliver(
        &format!(
            "amqps://{USER}@127.0.0.1:{tls_port}/%2f?{}&password_file={}",
            pki.params(),
            pki.show("amqp-pw")
        ),
        "tls.rabbitmq",
        2,
    )
    .await;
    let q = ch
        .queue_declare(
            "tls.rabbitmq".into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(q.message_count(), 7);

    let e = open_error(&format!(
        "amqps://{USER}:{PASSWORD}@127.0.0.1:{tls_port}/%2f?{}",
        pki.wrong_ca_params()
    ))
    .await;
    assert!(e.contains("UnknownIssuer"), "{e}");
    let e = open_error(&format!(
        "amqps://{USER}:wrong-password@127.0.0.1:{tls_port}/%2f?{}",
        pki.params()
    ))
    .await;
    assert!(e.contains("refused the credentials"), "{e}");
    let e = open_error(&format!(
        "amqp://{USER}:{PASSWORD}@127.0.0.1:{tls_port}/%2f"
    ))
    .await;
    assert!(e.contains("speaks TLS: use amqps://"), "{e}");
}

// ---------------------------------------------------------------------------------------
// HTTPS webhook

/// A minimal HTTPS endpoint that requires a client certificate from the test CA and
/// answers 200 to requests carrying the expected bearer token, 401 to others; it counts
/// the requests it accepted.
async fn https_endpoint(
    pki: &Pki,
    token: &'static str,
) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    #[allow(deprecated)] // ring, the workspace's provider (deprecated in rustls 0.23.48)
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(pki.path("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let certs = CertificateDer::pem_file_iter(pki.path("server.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(pki.path("server.key")).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let count = count.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut tls = tokio::io::BufReader::new(tls);
                loop {
                    let mut length = 0usize;
                    let mut authorized = false;
                    let mut line = String::new();
                    if tls.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        let mut h = String::new();
                        if tls.read_line(&mut h).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let h = h.trim_end();
                        if h.is_empty() {
                            break;
                        }
                        let (name, value) = h.split_once(':').unwrap_or((h, ""));
                        match name.to_ascii_lowercase().as_str() {
                            "content-length" => length = value.trim().parse().unwrap_or(0),
                            "authorization" => {
                                authorized = value.trim() == format!("Bearer {token}")
                            }
                            _ => {}
                        }
                    }
                    let mut body = vec![0; length];
                    if tls.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    let status = if authorized {
                        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        "200 OK"
                    } else {
                        "401 Unauthorized"
                    };
                    let reply = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
                    if tls.get_mut().write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, accepted)
}

#[tokio::test]
async fn webhook_over_https_with_client_certificates_and_a_bearer_token() {
    let pki = Pki::new();
    let token = "bearer-TLS-token";
    let (port, accepted) = https_endpoint(&pki, token).await;
    std::fs::write(pki.path("bearer"), format!("{token}\n")).unwrap();
    let ours = format!(
        "outbox_ca={}&outbox_cert={}&outbox_key={}",
        pki.show("ca.pem"),
        pki.show("client.pem"),
        pki.show("client.key")
    );
    // The endpoint's own `key` parameter stays the endpoint's.
    deliver(
        &format!(
            "https://127.0.0.1:{port}/hook?key=theirs&{ours}&outbox_bearer_file={}",
            pki.show("bearer")
        ),
        "tls.webhook",
        4,
    )
    .await;
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 4);

    let e = open_error(&format!(
        "https://127.0.0.1:{port}/hook?outbox_ca={}",
        pki.show("other-ca.pem")
    ))
    .await;
    assert!(e.contains("UnknownIssuer"), "{e}");
    // Without the bearer token the endpoint answers 401: a permanent refusal.
    let sink = outbox::sink::open(&format!("https://127.0.0.1:{port}/hook?{ours}"))
        .await
        .unwrap();
    let r = sink
        .publish_all(&[outgoing(1, "tls.webhook", None, b"x".to_vec())])
        .await;
    let err = r[0].as_ref().unwrap_err();
    assert_eq!(err.kind, outbox::sink::ErrorKind::Permanent, "{err}");
    let e = open_error(&format!(
        "http://127.0.0.1:{port}/hook?outbox_cert={}&outbox_key={}",
        pki.show("client.pem"),
        pki.show("client.key")
    ))
    .await;
    assert!(e.contains("need an https:// URL"), "{e}");
}

/// Files that cannot be read or parsed are named in the error, before anything connects.
#[tokio::test]
async fn unreadable_tls_files_are_named_at_open() {
    let pki = Pki::new();
    let missing = pki.path("missing.pem");
    for url in [
        format!("tls://127.0.0.1:4222?ca={}", missing.display()),
        format!("rediss://127.0.0.1:1?ca={}", missing.display()),
        format!("amqps://127.0.0.1:1/%2f?ca={}", missing.display()),
        format!("mqtts://127.0.0.1:1?ca={}", missing.display()),
        format!("https://127.0.0.1:1/?outbox_ca={}", missing.display()),
    ] {
        match outbox::sink::open(&url).await {
            Err(e @ SinkError::InvalidUrl { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("missing.pem") && text.contains("cannot read ca"),
                    "{url}: {text}"
                );
            }
            Err(other) => panic!("{url}: {other}"),
            Ok(s) => panic!("{url}: opened {}", s.describe()),
        }
    }
}

/// A server that takes the TCP connection and then says nothing, or closes it at once (a
/// proxy or a sidecar whose broker is down, a broker still starting), is an outage: every
/// sink opens, within a bounded wait, and waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_is_an_outage() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = silent.accept().await {
            held.push(tcp);
        }
    });
    let closing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closing_port = closing.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = closing.accept().await {
            drop(tcp);
        }
    });
    let mut urls = Vec::new();
    for port in [silent_port, closing_port] {
        urls.extend([
            format!("nats://127.0.0.1:{port}"),
            format!("tls://127.0.0.1:{port}"),
            format!("rediss://127.0.0.1:{port}"),
            format!("amqps://127.0.0.1:{port}/%2f"),
            format!("mqtts://127.0.0.1:{port}"),
            format!("https://127.0.0.1:{port}/hook"),
        ]);
    }
    let opened = futures::future::join_all(urls.iter().map(|url| async move {
        let start = Instant::now();
        let r = outbox::sink::open(url).await;
        (url, start.elapsed(), r.map(|s| s.describe()))
    }))
    .await;
    for (url, took, r) in opened {
        if let Err(e) = r {
            panic!(
                "{url}: {e} ({})",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            );
        }
        assert!(took < Duration::from_secs(20), "{url} took {took:?}");
    }
}
