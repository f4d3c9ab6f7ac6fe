//! Validated SQL identifiers: the only way a configurable schema or table name reaches SQL.

use crate::error::Error;
use std::fmt;

/// A schema or table-prefix name that is safe to paste into SQL text: 1–63 characters of
/// `a-z`, `0-9` and `_`, starting with a letter or `_` (PostgreSQL's unquoted identifier
/// rules, lower case only, within its 63-byte limit).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ident(String);

impl Ident {
    /// Validates `name`.
    ///
    /// # Errors
    /// [`Error::InvalidIdentifier`] when `name` breaks the rules above.
    pub fn new(name: &str) -> Result<Self, Error> {
        let mut chars = name.chars();
        let ok = match chars.next() {
            Some(c) if c.is_ascii_lowercase() || c == '_' => chars
                .clone()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            _ => false,
        };
        if !ok || name.len() > 63 {
            return Err(Error::InvalidIdentifier(name.to_owned()));
        }
        Ok(Ident(name.to_owned()))
    }

    /// The identifier text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Ident {
    fn default() -> Self {
        Ident("outbox".to_owned())
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::Ident;

    #[test]
    fn accepts_plain_identifiers() {
        for ok in ["outbox", "_x", "a1_b2", &"a".repeat(63)] {
            assert!(Ident::new(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_anything_that_could_escape() {
        for bad in [
            "",
            "1abc",
            "Outbox",
            "out box",
            "outbox;drop table x",
            "a\"b",
            "a.b",
            &"a".repeat(64),
            "é",
        ] {
            assert!(Ident::new(bad).is_err(), "{bad:?}");
        }
    }
}
