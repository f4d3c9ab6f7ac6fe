//! The file sink: a JSON-lines file of its own per instance, read back line by line with
//! `envelope::from_json_line`. It keeps every copy (no deduplication), refuses no topic
//! and has no broker to be down, so it runs the suite's `local` cases.

use super::{Harness, Received};
use async_trait::async_trait;
use outbox::sink::Sink;
use outbox::sink::file::FileSink;
use std::path::PathBuf;
use tempfile::TempDir;

pub(crate) struct FileHarness {
    dir: TempDir,
}

impl FileHarness {
    fn path(&self) -> PathBuf {
        self.dir.path().join("out.jsonl")
    }
}

#[async_trait]
impl Harness for FileHarness {
    const DEDUPLICATES: bool = false;

    async fn setup() -> Self {
        FileHarness {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn topic(&self, label: &str) -> String {
        format!("file.{label}")
    }

    async fn sink(&self) -> Box<dyn Sink> {
        Box::new(FileSink::open(self.path()).await.unwrap())
    }

    async fn size_limit(&self) -> Option<usize> {
        None
    }

    /// A confirmed batch is on disk (written, flushed and synced) before the confirmation,
    /// so the file holds everything at once.
    async fn read(&mut self, expected: usize) -> Vec<Received> {
        let bytes = std::fs::read(self.path()).unwrap_or_default();
        let got: Vec<Received> = bytes
            .split_inclusive(|b| *b == b'\n')
            .map(|line| Received::from(outbox::envelope::from_json_line(line).unwrap()))
            .collect();
        assert!(got.len() >= expected, "{} of {expected} lines", got.len());
        got
    }

    async fn cleanup(self) {}
}
