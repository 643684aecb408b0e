//! Text for a terminal from untrusted sources (the model, tool output, files
//! in the workspace). Control characters are shown as visible escapes rather
//! than sent raw, so no escape sequence can move the cursor, clear or retitle
//! the screen, hide text or set the clipboard (OSC 52); newlines and tabs
//! pass, and a CRLF line ending becomes a newline.

use std::borrow::Cow;

/// `text` with every control character except `\n` and `\t` replaced by its
/// visible `\u{..}` escape: C0 (ESC, BEL, lone CR, …), DEL and C1 (such as
/// the one-byte CSI U+009B).
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
    c.is_control() && c != '\n' && c != '\t'
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
}
