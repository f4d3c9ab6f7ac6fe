//! Topic patterns: NATS-style wildcards over dotted topics, as routes, topic pauses,
//! per-key ordering and operator selectors name sets of topics.
//!
//! A token matches itself, `*` matches exactly one token, `>` (last) matches one or more
//! tokens. `orders.*` matches `orders.placed`, not `orders.placed.v1`; `orders.>` matches
//! both; `>` matches everything. The stores match the same rule in SQL through the
//! pattern's regex (`TopicPattern::regex`, next to the stores' queries).
//!
//! Vocabulary: parsing and matching only, no IO.

/// Longest topic pattern accepted, in bytes: [`crate::message::MAX_TOPIC_BYTES`]. Each
/// token of a pattern matches at least as many bytes as it has, so a longer pattern could
/// match no topic at all.
pub const MAX_PATTERN_BYTES: usize = crate::message::MAX_TOPIC_BYTES;

/// Most tokens a topic pattern may have. NATS advises keeping subjects to about 16
/// tokens; 32 leaves room, and keeps the pattern's regex ([`TopicPattern::regex`]) far
/// below what PostgreSQL refuses as "too complex" (some thousands of wildcards).
pub const MAX_PATTERN_TOKENS: usize = 32;

/// A topic pattern (see the module docs): at most [`MAX_PATTERN_BYTES`] bytes and
/// [`MAX_PATTERN_TOKENS`] tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicPattern {
    text: String,
    tokens: Vec<String>,
}

impl TopicPattern {
    /// Parses `pattern`.
    ///
    /// # Errors
    /// A message when the pattern is longer than [`MAX_PATTERN_BYTES`] or has more than
    /// [`MAX_PATTERN_TOKENS`] tokens, holds whitespace or a control character, a token is
    /// empty, `>` is not the last token, or a token mixes a wildcard with other characters.
    pub fn parse(pattern: &str) -> Result<Self, String> {
        if pattern.len() > MAX_PATTERN_BYTES {
            return Err(format!(
                "topic pattern is {} bytes, longer than the {MAX_PATTERN_BYTES} bytes a topic may have",
                pattern.len()
            ));
        }
        let count = pattern.split('.').count();
        if count > MAX_PATTERN_TOKENS {
            return Err(format!(
                "topic pattern has {count} tokens, more than {MAX_PATTERN_TOKENS}"
            ));
        }
        if let Some(c) = pattern
            .chars()
            .find(|c| c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "pattern {:?} contains {c:?}: topics have no whitespace or control characters",
                pattern.escape_debug().to_string()
            ));
        }
        let tokens: Vec<String> = pattern.split('.').map(str::to_owned).collect();
        for (i, t) in tokens.iter().enumerate() {
            if t.is_empty() {
                return Err(format!("topic pattern {pattern:?} has an empty token"));
            }
            if t == ">" && i + 1 != tokens.len() {
                return Err(format!(
                    "topic pattern {pattern:?}: `>` must be the last token"
                ));
            }
            if t.len() > 1 && (t.contains('*') || t.contains('>')) {
                return Err(format!(
                    "topic pattern {pattern:?}: `*` and `>` must be whole tokens"
                ));
            }
        }
        Ok(TopicPattern {
            text: pattern.to_owned(),
            tokens,
        })
    }

    /// Does `topic` match? The same rule as [`TopicPattern::regex`], which the stores
    /// match in SQL (topic pauses, per-key ordering): a wildcard never matches an empty
    /// token (`o.*` does not match `o.`), and `>` needs something after the dot.
    pub fn matches(&self, topic: &str) -> bool {
        let mut rest = topic;
        for (i, t) in self.tokens.iter().enumerate() {
            if t == ">" {
                // One or more characters remain (one or more tokens, as `.+`).
                return !rest.is_empty() && i + 1 == self.tokens.len();
            }
            let (part, after) = match rest.split_once('.') {
                Some((p, a)) => (p, Some(a)),
                None => (rest, None),
            };
            let ok = if t == "*" {
                !part.is_empty()
            } else {
                t == part
            };
            if !ok {
                return false;
            }
            match after {
                Some(a) if i + 1 < self.tokens.len() => rest = a,
                Some(_) => return false,
                None => return i + 1 == self.tokens.len(),
            }
        }
        false
    }

    /// `>`: every topic.
    pub(crate) fn everything() -> Self {
        TopicPattern {
            text: ">".into(),
            tokens: vec![">".into()],
        }
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn m(p: &str, t: &str) -> bool {
        TopicPattern::parse(p)
            .unwrap_or_else(|e| panic!("{e}"))
            .matches(t)
    }

    #[test]
    fn wildcards_match_like_nats_subjects() {
        assert!(m("orders.*", "orders.placed"));
        assert!(!m("orders.*", "orders.placed.v1"));
        assert!(!m("orders.*", "orders"));
        assert!(m("orders.>", "orders.placed"));
        assert!(m("orders.>", "orders.placed.v1"));
        assert!(!m("orders.>", "orders"));
        assert!(m(">", "anything.at.all"));
        assert!(m("*.placed.*", "orders.placed.v1"));
        assert!(!m("*.placed.*", "orders.shipped.v1"));
        assert!(m("orders.placed.v1", "orders.placed.v1"));
        assert!(!m("orders.placed.v1", "orders.placed.v2"));
    }

    /// Topics with empty tokens (which `enqueue` accepts) match as the pattern's regex
    /// does in SQL, so the relay and the claim agree on which topics are ordered.
    #[test]
    fn empty_tokens_match_as_the_regex_does() {
        // `^o\..+$`, `^o\.[^.]+$`, `^o\.[^.]+\.b$`, `^[^.]+$`
        for (p, t, regex_matches) in [
            ("o.>", "o.", false),
            ("o.>", "o..x", true),
            ("o.*", "o.", false),
            ("o.*.b", "o..b", false),
            ("*", "", false),
            ("o.*", "o.x", true),
            ("o.x", "o.x.", false),
        ] {
            assert_eq!(m(p, t), regex_matches, "{p} against {t:?}");
        }
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in ["", "a..b", "a.>.b", "a.b*", "a.>x", "."] {
            assert!(TopicPattern::parse(bad).is_err(), "{bad:?}");
        }
    }

    /// Length and token count are bounded, so no pattern's regex is too complex for a
    /// store; the largest accepted ones parse.
    #[test]
    fn patterns_are_bounded_in_length_and_tokens() {
        let tokens = |n: usize, t: &str| vec![t; n].join(".");
        let e = TopicPattern::parse(&tokens(50_000, "*")).unwrap_err();
        assert!(e.contains("longer than the 255"), "{e}");
        let e = TopicPattern::parse(&"a".repeat(256)).unwrap_err();
        assert!(e.contains("256 bytes"), "{e}");
        assert!(TopicPattern::parse(&"a".repeat(255)).is_ok());
        let e = TopicPattern::parse(&tokens(33, "*")).unwrap_err();
        assert!(e.contains("33 tokens, more than 32"), "{e}");
        assert!(TopicPattern::parse(&tokens(32, "*")).is_ok());
        let long_tokens = tokens(32, &"x".repeat(7));
        assert_eq!(long_tokens.len(), 255);
        assert!(TopicPattern::parse(&long_tokens).is_ok());
    }
}
