//! Per-message retry backoff: a pure function whose result the relay stores in the row
//! (`available_at = now + delay`), so N relays do not retry N times as often.

use std::time::Duration;

/// Exponential backoff with "equal jitter": the ceiling is `base * 2^(attempt-1)` capped at
/// `max`; the delay is drawn uniformly from `[ceiling/2, ceiling]` using `jitter` in
/// `[0, 1)`. Half the delay is guaranteed (so a retry storm is spread, never immediate);
/// the other half is random (so replicas that failed together retry apart).
///
/// `attempt` counts from 1 (the attempt that just failed).
pub fn delay(attempt: i32, base: Duration, max: Duration, jitter: f64) -> Duration {
    let exp = u32::try_from(attempt.saturating_sub(1).clamp(0, 62)).unwrap_or(62);
    let ceiling = base
        .checked_mul(2u32.saturating_pow(exp.min(31)))
        .unwrap_or(max)
        .min(max);
    let half = ceiling / 2;
    half + half.mul_f64(jitter.clamp(0.0, 1.0))
}

/// [`delay`] with a random jitter.
pub fn jittered(attempt: i32, base: Duration, max: Duration) -> Duration {
    delay(attempt, base, max, rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    use super::delay;
    use std::time::Duration;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn grows_exponentially_within_jitter_bounds() {
        let max = Duration::from_secs(300);
        assert_eq!(delay(1, S, max, 0.0), Duration::from_millis(500));
        assert_eq!(delay(1, S, max, 1.0), S);
        assert_eq!(delay(4, S, max, 0.0), Duration::from_secs(4));
        assert_eq!(delay(4, S, max, 1.0), Duration::from_secs(8));
    }

    #[test]
    fn is_capped_and_never_overflows() {
        let max = Duration::from_secs(300);
        assert_eq!(delay(1_000, S, max, 1.0), max);
        assert_eq!(delay(i32::MAX, S, max, 0.0), max / 2);
        assert_eq!(delay(0, S, max, 1.0), S);
        assert_eq!(delay(-5, S, max, 1.0), S);
    }
}
