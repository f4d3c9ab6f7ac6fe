//! `stdout` and `file:PATH` sinks: one JSON object per line.
//!
//! Line shape: `{"message_id", "topic", "key", "occurred_at", "attempt", "headers": {…},
//! "payload_encoding": "utf8" | "base64", "payload"}`. The payload is written as text when
//! it is valid UTF-8, else base64 (standard alphabet, padded): bytes round-trip either way.
//! A file batch counts as confirmed once written, flushed and `fsync`ed (`sync_data`).

use super::{Confirmations, PublishCode, PublishError, Sink};
use crate::message::OutgoingMessage;
use async_trait::async_trait;
use base64::Engine;
use std::path::{Path, PathBuf};
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

enum Target {
    Stdout,
    File {
        path: PathBuf,
        file: tokio::fs::File,
    },
}

/// The stdout / file sink.
pub struct FileSink {
    target: Mutex<Target>,
    describe: String,
}

impl std::fmt::Debug for FileSink {
    /// The description only, as logs show it: no credentials (see [`Sink::describe`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("FileSink").field(&self.describe()).finish()
    }
}

impl FileSink {
    /// JSON lines on standard output.
    pub fn stdout() -> Self {
        FileSink {
            target: Mutex::new(Target::Stdout),
            describe: "stdout".into(),
        }
    }

    /// JSON lines appended to `path` (created when missing).
    ///
    /// # Errors
    /// The I/O error when the file cannot be opened for appending.
    pub async fn open(path: impl AsRef<Path>) -> std::io::Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .await?;
        Ok(FileSink {
            describe: format!("file:{}", path.display()),
            target: Mutex::new(Target::File { path, file }),
        })
    }
}

/// One message as a JSON line (with the trailing newline).
pub fn to_json_line(m: &OutgoingMessage) -> Vec<u8> {
    let (encoding, payload) = match std::str::from_utf8(&m.payload) {
        Ok(text) => ("utf8", text.to_owned()),
        Err(_) => (
            "base64",
            base64::engine::general_purpose::STANDARD.encode(&m.payload),
        ),
    };
    let value = serde_json::json!({
        "message_id": m.message_id,
        "topic": m.topic,
        "key": m.key,
        "occurred_at": m.occurred_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "attempt": m.attempts,
        "headers": m.headers,
        "payload_encoding": encoding,
        "payload": payload,
    });
    let mut line = value.to_string().into_bytes();
    line.push(b'\n');
    line
}

/// Reads a payload back from a JSON line written by this sink (now
/// [`crate::envelope::payload_from_json_line`], beside the reader of the whole line).
pub use crate::envelope::payload_from_json_line;

#[async_trait]
impl Sink for FileSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let mut buf = Vec::with_capacity(batch.len() * 256);
        for m in batch {
            buf.extend_from_slice(&to_json_line(m));
        }
        let mut target = self.target.lock().await;
        let result = match &mut *target {
            Target::Stdout => {
                let mut out = tokio::io::stdout();
                match out.write_all(&buf).await {
                    Ok(()) => out.flush().await,
                    Err(e) => Err(e),
                }
            }
            Target::File { file, .. } => {
                async {
                    file.write_all(&buf).await?;
                    file.flush().await?;
                    file.sync_data().await
                }
                .await
            }
        };
        let outcome = result.map_err(|e| {
            let place = match &*target {
                Target::Stdout => "stdout".to_owned(),
                Target::File { path, .. } => path.display().to_string(),
            };
            PublishError::unavailable(format!("writing to {place} failed: {e}"))
                .with_code(PublishCode::IoError)
        });
        for i in 0..batch.len() {
            confirm.set(i, outcome.clone());
        }
    }

    async fn close(&self) {
        let mut target = self.target.lock().await;
        if let Target::File { file, .. } = &mut *target {
            let _ = file.flush().await;
            let _ = file.sync_all().await;
        }
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// What this sink writes, read back by [`crate::envelope::from_json_line`].
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::envelope::{Envelope, from_json_line};
    use crate::message::header;
    use bytes::Bytes;
    use chrono::{DateTime, Utc};
    use std::collections::BTreeMap;
    use uuid::Uuid;

    fn outgoing() -> OutgoingMessage {
        let mut headers = BTreeMap::new();
        headers.insert("tenant".to_owned(), "grüße ✓".to_owned());
        headers.insert(header::CORRELATION_ID.to_owned(), "req-7".to_owned());
        OutgoingMessage {
            id: 1,
            message_id: Uuid::now_v7(),
            topic: "orders.placed.v1".into(),
            key: Some("order-42".into()),
            payload: Bytes::from_static(&[0, 159, 146, 150, 255]),
            headers,
            occurred_at: DateTime::parse_from_rfc3339("2026-11-30T10:11:12.123456Z")
                .unwrap()
                .with_timezone(&Utc),
            attempts: 2,
        }
    }

    #[test]
    fn json_lines_round_trip_text_and_binary() {
        let mut m = outgoing();
        let env = from_json_line(&to_json_line(&m)).unwrap();
        assert_eq!(
            (&env.payload, &env.headers, env.occurred_at),
            (&m.payload, &m.headers, m.occurred_at)
        );
        m.payload = Bytes::from_static("plain ✓".as_bytes());
        m.key = None;
        let env = from_json_line(&to_json_line(&m)).unwrap();
        assert_eq!(env.payload, m.payload);
        assert_eq!(env.key, None);
    }

    #[tokio::test]
    async fn the_file_sink_round_trips_through_a_real_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let sink = FileSink::open(&path).await.unwrap();
        let mut text = outgoing();
        text.payload = Bytes::from_static("grüße ✓ {}".as_bytes());
        text.key = None;
        let mut empty = outgoing();
        empty.payload = Bytes::new();
        let batch = vec![outgoing(), text, empty];
        for r in sink.publish_all(&batch).await {
            r.unwrap();
        }
        let written = std::fs::read(&path).unwrap();
        let got: Vec<Envelope> = written
            .split_inclusive(|b| *b == b'\n')
            .map(|line| from_json_line(line).unwrap())
            .collect();
        assert_eq!(got.len(), batch.len());
        for (m, e) in batch.iter().zip(&got) {
            assert_eq!(e.message_id, m.message_id);
            assert_eq!(e.topic, m.topic);
            assert_eq!(e.key, m.key);
            assert_eq!(e.occurred_at, m.occurred_at);
            assert_eq!(e.headers, m.headers);
            assert_eq!(e.payload, m.payload);
        }
    }

    #[test]
    fn a_line_read_back_never_shows_the_payload() {
        let mut m = outgoing();
        m.payload = Bytes::from_static(b"SECRET-PAYLOAD");
        let e = from_json_line(&to_json_line(&m)).unwrap();
        assert!(!format!("{e:?}").contains("SECRET"));
    }
}
