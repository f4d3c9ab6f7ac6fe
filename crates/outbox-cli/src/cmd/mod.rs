//! One module per command: each holds its clap arguments and its `run` (the demo is
//! `crate::demo`). The flags several commands share are here.

pub(crate) mod change;
pub(crate) mod dead;
pub(crate) mod enqueue;
pub(crate) mod inbox;
pub(crate) mod migrate;
pub(crate) mod pause;
pub(crate) mod purge;
pub(crate) mod relay;
pub(crate) mod replay;
pub(crate) mod replays;
pub(crate) mod resume;
pub(crate) mod serve;
pub(crate) mod status;

/// Per-key ordering, as `relay`, `status` and `dead list` take it (one setting, the
/// same `OUTBOX_ORDERED` for all three).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct OrderingArgs {
    /// Per-key ordering for topics matching PATTERN (repeatable; `*` one token, `>` one
    /// or more at the end): the messages of one topic and key are published in id order,
    /// one after another, while other keys flow in parallel; messages without a key are
    /// never held back. A message that fails holds back only its key; a dead one blocks
    /// its key until replayed or discarded (see --ordered-skip-dead). Every relay of the
    /// outbox, and status and dead list, must be given the same patterns. In
    /// OUTBOX_ORDERED, separate patterns by spaces.
    #[arg(long = "ordered", env = "OUTBOX_ORDERED", value_delimiter = ' ', value_parser = outbox::sink::router::TopicPattern::parse)]
    pub(crate) ordered: Vec<outbox::sink::router::TopicPattern>,
    /// With --ordered: a dead message does not block its key; the later messages go on
    /// and the gap stays in the dead letters (availability over order).
    #[arg(long, env = "OUTBOX_ORDERED_SKIP_DEAD", requires = "ordered")]
    pub(crate) ordered_skip_dead: bool,
}

impl OrderingArgs {
    /// The ordering these flags give.
    pub(crate) fn ordering(&self) -> outbox::store::KeyOrdering {
        outbox::store::KeyOrdering {
            topics: self.ordered.clone(),
            skip_dead: self.ordered_skip_dead,
        }
    }
}
