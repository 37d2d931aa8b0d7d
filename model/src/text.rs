//! The one sanitiser for text that comes from processes or users (process
//! names, command lines, file names, crontab lines, cgroup names) before
//! it reaches a terminal, a table or a log line.

/// `s` with every character that could steer a terminal or forge output
/// replaced by `?`: control characters (C0 and C1, so ESC sequences, tabs
/// and newlines: `char::is_control`), the line and paragraph separators
/// (U+2028, U+2029), and the bidirectional marks, overrides and isolates
/// (U+061C, U+200E, U+200F, U+202A–U+202E, U+2066–U+2069, the "Trojan
/// Source" characters, Unicode TR #9), which reorder what a reader sees.
pub fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control()
                || matches!(
                    c,
                    '\u{061C}'
                        | '\u{200E}'
                        | '\u{200F}'
                        | '\u{2028}'
                        | '\u{2029}'
                        | '\u{202A}'..='\u{202E}'
                        | '\u{2066}'..='\u{2069}'
                )
            {
                '?'
            } else {
                c
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escapes_and_overrides_are_replaced() {
        assert_eq!(printable("\u{1b}]0;pwned\u{7}ok"), "?]0;pwned?ok");
        assert_eq!(printable("a\tb\nc\r"), "a?b?c?");
        assert_eq!(printable("\u{9b}31m"), "?31m", "C1 CSI");
        assert_eq!(printable("abc\u{202E}txt.exe"), "abc?txt.exe");
        assert_eq!(printable("gpu\u{2066}x\u{2069}"), "gpu?x?");
        assert_eq!(
            printable("a\u{200E}b\u{200F}c\u{061C}d\u{2028}e\u{2029}"),
            "a?b?c?d?e?"
        );
        assert_eq!(printable("ünïcode ok ✓"), "ünïcode ok ✓");
    }

    proptest! {
        #[test]
        fn output_is_printable_and_as_long(s in any::<String>()) {
            let p = printable(&s);
            prop_assert_eq!(p.chars().count(), s.chars().count());
            prop_assert!(!p.chars().any(|c| c.is_control()));
        }
    }
}
