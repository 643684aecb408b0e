//! Text for a terminal from untrusted sources (the model, tool output, files
//! in the workspace, titles). Control and format characters are shown as
//! visible escapes rather than sent raw, so no escape sequence can move the
//! cursor, clear or retitle the screen, hide text or set the clipboard
//! (OSC 52), and no bidi control or zero-width character can reorder or
//! hide what is shown; newlines and tabs pass, and a CRLF line ending
//! becomes a newline.

use std::borrow::Cow;

/// `text` with every control character except `\n` and `\t`, and every
/// format character, replaced by its visible `\u{..}` escape: C0 (ESC, BEL,
/// lone CR, …), DEL, C1 (such as the one-byte CSI U+009B), bidi controls
/// (U+202A–U+202E, U+2066–U+2069, U+061C), zero-width characters and the
/// rest of Unicode category Cf.
pub fn neutralize(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\r' && chars.peek() == Some(&'\n') {
            continue;
        }
        if is_unsafe(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

fn is_unsafe(c: char) -> bool {
    keel_core::is_invisible(c) && c != '\n' && c != '\t'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_sequences_become_visible_and_text_stays() {
        assert!(matches!(neutralize("plain\ttext\n"), Cow::Borrowed(_)));
        assert_eq!(
            neutralize("\u{1b}]52;c;aGk=\u{7}copy\u{9b}2J\r\nnext\rover\u{7f}é"),
            "\\u{1b}]52;c;aGk=\\u{7}copy\\u{9b}2J\nnext\\u{d}over\\u{7f}é"
        );
    }

    #[test]
    fn bidi_zero_width_and_format_characters_become_visible() {
        // "invoice_" + RLO + "fdp.exe" would show as "invoice_exe.pdf".
        assert_eq!(
            neutralize("invoice_\u{202e}fdp.exe"),
            "invoice_\\u{202e}fdp.exe"
        );
        let each = [
            '\u{202a}',
            '\u{202b}',
            '\u{202c}',
            '\u{202d}',
            '\u{202e}',
            '\u{2066}',
            '\u{2067}',
            '\u{2068}',
            '\u{2069}',
            '\u{61c}',
            '\u{200b}',
            '\u{200c}',
            '\u{200d}',
            '\u{200e}',
            '\u{200f}',
            '\u{2060}',
            '\u{feff}',
            '\u{ad}',
            '\u{e0041}',
        ];
        for c in each {
            let shown = neutralize(&format!("a{c}b")).into_owned();
            assert_eq!(shown, format!("a\\u{{{:x}}}b", u32::from(c)));
        }
        assert!(matches!(neutralize("naïve 日本 😀 →"), Cow::Borrowed(_)));
    }
}
