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

/// Reads a payload back from a JSON line written by this sink.
pub fn payload_from_json_line(value: &serde_json::Value) -> Option<Vec<u8>> {
    let payload = value.get("payload")?.as_str()?;
    match value.get("payload_encoding")?.as_str()? {
        "utf8" => Some(payload.as_bytes().to_vec()),
        "base64" => base64::engine::general_purpose::STANDARD
            .decode(payload)
            .ok(),
        _ => None,
    }
}

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
