//! Images of user messages: the media types keel accepts (recognised by
//! their magic bytes, never by a declared type) and the `keel-image:` URIs
//! by which messages refer to images stored by content hash.

/// The prefix of a stored image's URI; the SHA-256 of its bytes (64 lowercase hex digits) follows.
pub const IMAGE_URI_PREFIX: &str = "keel-image:sha256:";

/// The media types keel accepts, as `image/…` names.
pub const IMAGE_MEDIA_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// The media type of `bytes` read from their magic bytes, if they are an accepted image.
pub fn sniff_image(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some("image/jpeg")
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// The URI of the stored image whose SHA-256 is `sha256_hex`.
pub fn image_uri(sha256_hex: &str) -> String {
    format!("{IMAGE_URI_PREFIX}{sha256_hex}")
}

/// The SHA-256 (hex) a `keel-image:` URI names; `None` for any other URI or a malformed hash.
pub fn stored_image_hash(uri: &str) -> Option<&str> {
    let hash = uri.strip_prefix(IMAGE_URI_PREFIX)?;
    is_sha256_hex_str(hash).then_some(hash)
}

/// Whether `s` is 64 lowercase hex digits.
pub fn is_sha256_hex_str(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffs_by_magic_bytes() {
        assert_eq!(sniff_image(b"\x89PNG\r\n\x1a\n...."), Some("image/png"));
        assert_eq!(sniff_image(&[0xFF, 0xD8, 0xFF, 0xE0]), Some("image/jpeg"));
        assert_eq!(sniff_image(b"GIF89a.."), Some("image/gif"));
        assert_eq!(sniff_image(b"RIFF\0\0\0\0WEBPVP8 "), Some("image/webp"));
        assert_eq!(sniff_image(b"RIFF\0\0\0\0WAVEfmt "), None);
        assert_eq!(sniff_image(b"<svg xmlns="), None);
        assert_eq!(sniff_image(b""), None);
        for bytes in [&b"\x89PNG\r\n\x1a\n"[..], b"GIF87a", b"RIFF\0\0\0\0WEBP"] {
            assert!(IMAGE_MEDIA_TYPES.contains(&sniff_image(bytes).unwrap()));
        }
    }

    #[test]
    fn uris_round_trip_and_reject_malformed_hashes() {
        let hash = "a".repeat(64);
        assert_eq!(stored_image_hash(&image_uri(&hash)), Some(hash.as_str()));
        assert_eq!(stored_image_hash(&image_uri(&"A".repeat(64))), None);
        assert_eq!(stored_image_hash(&image_uri("abc")), None);
        assert_eq!(stored_image_hash("https://example.com/a.png"), None);
    }
}
