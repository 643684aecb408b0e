//! Characters that change how text looks without being seen: format
//! characters (Unicode general category Cf), which include the bidi
//! overrides, embeddings and isolates (U+202A–U+202E, U+2066–U+2069,
//! U+061C) and the zero-width characters. A terminal escapes them and a
//! title refuses them, so no model or client can make text read other than
//! it is.

/// The Cf ranges of Unicode 15.1 (inclusive), in order.
const FORMAT_RANGES: &[(u32, u32)] = &[
    (0x00AD, 0x00AD),
    (0x0600, 0x0605),
    (0x061C, 0x061C),
    (0x06DD, 0x06DD),
    (0x070F, 0x070F),
    (0x0890, 0x0891),
    (0x08E2, 0x08E2),
    (0x180E, 0x180E),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x206F),
    (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),
];

/// Whether `c` is a format character (general category Cf): bidi
/// controls, zero-width characters, the soft hyphen, tag characters …
fn is_format_char(c: char) -> bool {
    let c = u32::from(c);
    FORMAT_RANGES
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

/// Whether `c` would be unseen or act on a display: a control character
/// (C0, DEL, C1) or a format character.
pub fn is_invisible(c: char) -> bool {
    c.is_control() || is_format_char(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bidi_controls_zero_width_and_other_format_characters_are_found() {
        let bidi = ('\u{202A}'..='\u{202E}').chain('\u{2066}'..='\u{2069}');
        for c in bidi.chain(['\u{061C}', '\u{200B}', '\u{200C}', '\u{200D}', '\u{200E}']) {
            assert!(is_format_char(c), "{:x}", u32::from(c));
        }
        for c in ['\u{2060}', '\u{FEFF}', '\u{00AD}', '\u{E0041}', '\u{1343F}'] {
            assert!(is_format_char(c), "{:x}", u32::from(c));
        }
        for c in [
            'a', ' ', 'é', '\u{2028}', '\u{3000}', '😀', '\u{202F}', '\u{2065}',
        ] {
            assert!(!is_format_char(c), "{:x}", u32::from(c));
        }
        assert!(is_invisible('\u{1b}') && is_invisible('\u{9b}') && is_invisible('\u{2067}'));
        assert!(FORMAT_RANGES.windows(2).all(|w| w[0].1 < w[1].0));
    }
}
