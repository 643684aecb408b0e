//! Images in user input: the `parts` of a send (text, base64 images, image
//! URLs), checked against the server's limits and the model's, stored by
//! content hash before the input is queued; and `GET /api/images/{sha256}`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use keel_core::{image_uri, sniff_image, ContentPart, Message, SessionId};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::serve::api::MAX_TEXT_CHARS;
use crate::serve::openapi::Errors;
use crate::serve::problem::{ApiError, ApiPath, ApiResult};
use crate::serve::Shared;

/// Longest image URL, in bytes.
pub const MAX_IMAGE_URL_BYTES: usize = 2048;

/// One part of a message's input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum InputPart {
    /// Text.
    Text {
        /// The text (with every other text part, at most 100,000 characters).
        text: String,
    },
    /// An image: exactly one of `data` (base64 bytes, stored by the server) and `url` (an `https` URL the model fetches).
    Image {
        /// The image's bytes, base64 (standard alphabet, padded): a PNG, JPEG, GIF or WebP.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<String>,
        /// An `https` URL of the image (at most 2048 bytes), passed to the model as is.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        url: Option<String>,
        /// The declared media type; when given it must be what the bytes are.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mime_type: Option<String>,
    },
}

/// An image of a stored message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MessageImage {
    /// Where to read it: `/api/images/{sha256}` (behind the token) for a stored image, else the URL the client sent.
    pub url: String,
    /// Its media type, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mime_type: Option<String>,
}

/// The images of `message`, as clients read them.
pub(crate) fn message_images(message: &Message) -> Vec<MessageImage> {
    message
        .content
        .iter()
        .filter_map(|p| match p {
            ContentPart::ImageRef { uri, mime_type } => Some(MessageImage {
                url: match keel_core::stored_image_hash(uri) {
                    Some(hash) => format!("/api/images/{hash}"),
                    None => uri.clone(),
                },
                mime_type: mime_type.clone(),
            }),
            ContentPart::Text { .. } => None,
        })
        .collect()
}

/// A send's input, checked but with its images not yet stored.
pub(crate) struct CheckedInput {
    content: Vec<Result<String, Pending>>,
    images: usize,
}

/// An image a client sent, not yet stored.
enum Pending {
    /// Bytes to store, and their media type.
    Bytes(Vec<u8>, &'static str),
    /// A URL.
    Url(String),
}

impl Shared {
    /// The user message of a send with `text` and/or `parts` to `session`:
    /// checked (limits, types, the model takes images), its images stored
    /// (committed) before it returns. Nothing is stored when it fails.
    pub(crate) async fn user_input(
        &self,
        session: SessionId,
        text: Option<String>,
        parts: Vec<InputPart>,
    ) -> ApiResult<Message> {
        let checked = self.check_input(text, parts)?;
        self.store_input(session, checked).await
    }

    /// Checks a send's `text` and `parts` against the limits, reading no state.
    pub(crate) fn check_input(
        &self,
        text: Option<String>,
        parts: Vec<InputPart>,
    ) -> ApiResult<CheckedInput> {
        let mut content: Vec<Result<String, Pending>> = Vec::new();
        if let Some(text) = text {
            content.push(Ok(text));
        }
        let mut images = 0;
        for part in parts {
            match part {
                InputPart::Text { text } => content.push(Ok(text)),
                InputPart::Image {
                    data,
                    url,
                    mime_type,
                } => {
                    images += 1;
                    if images > self.limits.images_per_message {
                        return Err(ApiError::BadRequest(format!(
                            "a message may carry at most {} images (server.images_per_message)",
                            self.limits.images_per_message
                        )));
                    }
                    content.push(Err(self.image_part(data, url, mime_type.as_deref())?));
                }
            }
        }
        let chars: usize = content
            .iter()
            .filter_map(|c| c.as_ref().ok())
            .map(|t| t.chars().count())
            .sum();
        if chars > MAX_TEXT_CHARS {
            return Err(ApiError::BadRequest(format!(
                "text has {chars} characters; at most {MAX_TEXT_CHARS} are accepted"
            )));
        }
        if chars == 0 && images == 0 {
            return Err(ApiError::BadRequest(
                "the message is empty: send text or an image".to_owned(),
            ));
        }
        Ok(CheckedInput { content, images })
    }

    /// The user message of checked input to `session`, refused for a
    /// text-only model; its images are stored (committed) first.
    pub(crate) async fn store_input(
        &self,
        session: SessionId,
        input: CheckedInput,
    ) -> ApiResult<Message> {
        let CheckedInput { content, images } = input;
        if images > 0 && !self.app.manager.accepts_images(session).await? {
            return Err(text_only());
        }
        let mut message = Message::user("");
        message.content.clear();
        for part in content {
            message.content.push(match part {
                Ok(text) if text.is_empty() => continue,
                Ok(text) => ContentPart::Text { text },
                Err(Pending::Url(uri)) => ContentPart::ImageRef {
                    uri,
                    mime_type: None,
                },
                Err(Pending::Bytes(bytes, media_type)) => {
                    let stored = self.app.store.put_image(bytes).await?;
                    ContentPart::ImageRef {
                        uri: image_uri(&stored.sha256),
                        mime_type: Some(media_type.to_owned()),
                    }
                }
            });
        }
        Ok(message)
    }

    /// Checks one image part.
    fn image_part(
        &self,
        data: Option<String>,
        url: Option<String>,
        declared: Option<&str>,
    ) -> ApiResult<Pending> {
        match (data, url) {
            (Some(data), None) => {
                let max = self.limits.image_max_bytes;
                // Four base64 characters carry three bytes.
                if data.len() / 4 * 3 > max.saturating_add(3) {
                    return Err(too_large(max));
                }
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(data.trim())
                    .map_err(|_| {
                        ApiError::BadRequest("an image's data is not valid base64".to_owned())
                    })?;
                if bytes.len() > max {
                    return Err(too_large(max));
                }
                let media_type = checked_type(&bytes, declared)?;
                Ok(Pending::Bytes(bytes, media_type))
            }
            (None, Some(url)) => Ok(Pending::Url(checked_url(url)?)),
            _ => Err(ApiError::BadRequest(
                "an image part has exactly one of data and url".to_owned(),
            )),
        }
    }
}

/// The refusal of images for a model that takes text only.
fn text_only() -> ApiError {
    ApiError::BadRequest(
        "this dialog's model takes text only (its profile has images = false); \
         send the message without images"
            .to_owned(),
    )
}

/// Refuses `checked` input with images for `agent`'s text-only model, so an
/// endpoint that places a dialog first (OpenAI, AG-UI) creates none for it.
pub(crate) fn check_agent_takes(
    shared: &Shared,
    agent: Option<&keel_core::AgentId>,
    checked: &CheckedInput,
) -> ApiResult<()> {
    if checked.images > 0 && !shared.app.manager.agent_accepts_images(agent)? {
        return Err(text_only());
    }
    Ok(())
}

fn too_large(max: usize) -> ApiError {
    ApiError::PayloadTooLarge(format!(
        "an image is larger than {max} bytes (server.image_max_bytes)"
    ))
}

/// The media type the bytes are, refusing other bytes and a declared type that disagrees.
pub(crate) fn checked_type(bytes: &[u8], declared: Option<&str>) -> ApiResult<&'static str> {
    let Some(actual) = sniff_image(bytes) else {
        return Err(ApiError::BadRequest(
            "an image is not a PNG, JPEG, GIF or WebP (read from its bytes)".to_owned(),
        ));
    };
    match declared {
        Some(d) if !d.eq_ignore_ascii_case(actual) => Err(ApiError::BadRequest(format!(
            "an image is declared {d:?} but its bytes are {actual}"
        ))),
        _ => Ok(actual),
    }
}

/// An `https` image URL, at most [`MAX_IMAGE_URL_BYTES`].
pub(crate) fn checked_url(url: String) -> ApiResult<String> {
    if url.len() > MAX_IMAGE_URL_BYTES {
        return Err(ApiError::BadRequest(format!(
            "an image URL is longer than {MAX_IMAGE_URL_BYTES} bytes"
        )));
    }
    let host = url
        .strip_prefix("https://")
        .and_then(|rest| rest.split(['/', '?', '#']).next())
        .unwrap_or_default();
    let clean = !url.chars().any(|c| c.is_whitespace() || c.is_control());
    if host.is_empty() || !clean {
        return Err(ApiError::BadRequest(
            "an image URL must be an https URL".to_owned(),
        ));
    }
    Ok(url)
}

/// The stored image's bytes, served with its media type.
#[utoipa::path(get, path = "/api/images/{sha256}", tag = "dialogs",
    params(("sha256" = String, Path, description = "The image's SHA-256, 64 lowercase hex digits (as in its `keel-image:sha256:` URI)")),
    responses(
        (status = 200, description = "The image's bytes, with its stored media type", content(
            (Vec<u8> = "image/png"), (Vec<u8> = "image/jpeg"), (Vec<u8> = "image/gif"), (Vec<u8> = "image/webp"))),
        Errors))]
pub(crate) async fn get_image(
    State(shared): State<Arc<Shared>>,
    ApiPath(sha256): ApiPath<String>,
) -> ApiResult<Response> {
    let Some(image) = shared.app.store.image(&sha256).await? else {
        return Err(ApiError::NotFound(format!("image {sha256} not found")));
    };
    Ok((
        [
            (header::CONTENT_TYPE, image.media_type),
            (
                header::CACHE_CONTROL,
                "private, max-age=31536000, immutable".to_owned(),
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_owned()),
        ],
        image.bytes,
    )
        .into_response())
}
