//! The consumer's side: the inbox against each real database (`inbox`), and the whole
//! chain end to end through the example consumer (`consumer_e2e`).

mod consumer_e2e;
mod inbox;
