//! The image parts of the OpenAI and AG-UI endpoints' new input, as
//! keel's own [`InputPart`]s (checked and stored like a native send's).

use serde_json::Value;

use super::openai::{OpenAiError, OpenAiResult};
use crate::serve::images::InputPart;

/// The media type and base64 data of a `data:<type>;base64,<data>` URL.
fn data_url(url: &str) -> Option<(&str, &str)> {
    url.strip_prefix("data:")?.split_once(";base64,")
}

/// The `image_url` parts of the last message of `messages` (the new
/// input) as keel's image parts: a `data:…;base64,` URL as bytes, any
/// other URL as a URL (checked later: https only).
pub(super) fn openai_images(body: &[u8]) -> OpenAiResult<Vec<InputPart>> {
    let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let Some(parts) = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .and_then(|m| m.get("content"))
        .and_then(Value::as_array)
    else {
        return Ok(Vec::new());
    };
    let mut images = Vec::new();
    for (j, part) in parts.iter().enumerate() {
        if part.get("type").and_then(Value::as_str) != Some("image_url") {
            continue;
        }
        let url = part
            .get("image_url")
            .and_then(|u| u.get("url"))
            .and_then(Value::as_str)
            .ok_or_else(|| {
                OpenAiError::invalid(
                    &format!("content[{j}].image_url.url"),
                    "an image_url part needs a string `image_url.url`",
                )
            })?;
        images.push(match data_url(url) {
            Some((mime_type, data)) => InputPart::Image {
                data: Some(data.to_owned()),
                url: None,
                mime_type: Some(mime_type.to_owned()),
            },
            None => InputPart::Image {
                data: None,
                url: Some(url.to_owned()),
                mime_type: None,
            },
        });
    }
    Ok(images)
}

/// The image parts of the last message (the new input) as keel's: `image`
/// parts (`source` of type `data` with `value` and `mimeType`, or `url`
/// with `value`) and the older `binary` parts (`mimeType` with `data` or
/// `url`).
pub(super) fn agui_images(body: &[u8]) -> Vec<InputPart> {
    let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let Some(parts) = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .and_then(|m| m.get("content"))
        .and_then(Value::as_array)
    else {
        return Vec::new();
    };
    let text = |p: &Value, k: &str| p.get(k).and_then(Value::as_str).map(str::to_owned);
    // An image part with neither `data` nor `url` is refused by the check.
    parts
        .iter()
        .filter_map(|p| match p.get("type").and_then(Value::as_str) {
            Some("binary") => Some(p.clone()),
            Some("image") => {
                let source = p.get("source")?;
                let value = source.get("value").cloned();
                let key = match source.get("type").and_then(Value::as_str) {
                    Some("data") => "data",
                    _ => "url",
                };
                let mut binary = serde_json::json!({ "mimeType": source.get("mimeType") });
                binary[key] = value.unwrap_or(Value::Null);
                Some(binary)
            }
            _ => None,
        })
        .map(|p| {
            // A data URL in `url` is the same as `data`.
            let url = text(&p, "url");
            match url.as_deref().and_then(data_url) {
                Some((mime_type, data)) => InputPart::Image {
                    data: Some(data.to_owned()),
                    url: None,
                    mime_type: Some(mime_type.to_owned()),
                },
                None => InputPart::Image {
                    data: text(&p, "data"),
                    url,
                    mime_type: text(&p, "mimeType"),
                },
            }
        })
        .collect()
}
