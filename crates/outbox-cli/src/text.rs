//! Text for people: terminal-safe strings, clipped columns, grouped numbers and ages.

/// Text safe for a terminal: control characters escaped (never raw escape sequences).
pub(crate) fn safe(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

/// As [`safe`], keeping newlines and tabs.
pub(crate) fn safe_multiline(s: &str) -> String {
    s.split('\n')
        .map(|l| safe(&l.replace('\t', "    ")))
        .collect::<Vec<_>>()
        .join("\n")
}

pub(crate) fn one_line(s: &str) -> String {
    safe(&s.replace(['\n', '\r'], " "))
}

pub(crate) fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// `n` (grouped, as [`group`]) and `noun`, plural unless `n` is 1: "1 message",
/// "1,204 messages".
pub(crate) fn counted(n: impl Into<i128>, noun: &str) -> String {
    let n: i128 = n.into();
    format!("{} {noun}{}", group(n), if n == 1 { "" } else { "s" })
}

/// 1204 → "1,204" (any integer type up to 64 bits, signed or not).
pub(crate) fn group(n: impl Into<i128>) -> String {
    let n: i128 = n.into();
    let s = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// Seconds as "95 s", "14 min", "3.2 h", "2.0 d".
/// [`human`] of a number of seconds measured as a float (an age): the whole seconds,
/// rounded toward zero. `as` saturates (and takes NaN to 0); an age beyond `i64::MAX`
/// seconds would print in days all the same.
#[allow(clippy::cast_possible_truncation)]
pub(crate) fn human_f64(s: f64) -> String {
    human(s as i64)
}

pub(crate) fn human(s: i64) -> String {
    match s {
        s if s < 120 => format!("{s} s"),
        s if s < 7_200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{:.1} h", s as f64 / 3600.0),
        s => format!("{:.1} d", s as f64 / 86_400.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_never_reach_the_terminal() {
        assert_eq!(safe("a\u{1b}[31mb\u{7}"), "a\\u{1b}[31mb\\u{7}");
        assert_eq!(group(1_234_567), "1,234,567");
        assert_eq!(clip("abcdef", 4), "abc…");
    }
}
