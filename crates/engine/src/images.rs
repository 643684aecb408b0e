//! Stored images reach the model: a provider wrapper that replaces each
//! `keel-image:sha256:<hex>` reference of a request with a `data:` URL of
//! the stored bytes just before the call, so histories and replays keep
//! only the reference. Other URLs pass through untouched.

use std::sync::Arc;

use async_trait::async_trait;
use base64::Engine as _;
use keel_core::{
    stored_image_hash, CancellationToken, ChatRequest, ContentPart, Message, Provider,
    ProviderError, ProviderStream,
};
use keel_store::Store;

/// A provider whose requests have their stored images resolved to `data:` URLs.
pub struct ResolvingImages {
    inner: Arc<dyn Provider>,
    store: Store,
}

impl ResolvingImages {
    /// Wraps `inner`, reading images from `store`.
    pub fn wrap(inner: Arc<dyn Provider>, store: Store) -> Arc<dyn Provider> {
        Arc::new(Self { inner, store })
    }
}

fn has_stored_image(m: &Message) -> bool {
    m.content
        .iter()
        .any(|p| matches!(p, ContentPart::ImageRef { uri, .. } if stored_image_hash(uri).is_some()))
}

/// `request` with every stored image as a `data:` URL; `None` when it has none.
pub async fn resolve_images(
    store: &Store,
    request: &ChatRequest,
) -> Result<Option<ChatRequest>, ProviderError> {
    if !request.messages.iter().any(|m| has_stored_image(m)) {
        return Ok(None);
    }
    let mut resolved = request.clone();
    for message in &mut resolved.messages {
        if !has_stored_image(message) {
            continue;
        }
        let mut m = Message::clone(message);
        for part in &mut m.content {
            let ContentPart::ImageRef { uri, mime_type } = part else {
                continue;
            };
            let Some(hash) = stored_image_hash(uri) else {
                continue;
            };
            let image = match store.image(hash).await {
                Ok(Some(image)) => image,
                Ok(None) => {
                    tracing::error!(
                        image = hash,
                        "a message refers to an image that is not stored"
                    );
                    return Err(ProviderError::Unavailable(
                        "an image of the conversation is not stored".into(),
                    ));
                }
                Err(e) => {
                    tracing::error!(image = hash, error = %e, "cannot read a stored image");
                    return Err(ProviderError::Unavailable(
                        "an image of the conversation cannot be read".into(),
                    ));
                }
            };
            let data = base64::engine::general_purpose::STANDARD.encode(&image.bytes);
            *uri = format!("data:{};base64,{data}", image.media_type);
            *mime_type = Some(image.media_type);
        }
        *message = Arc::new(m);
    }
    Ok(Some(resolved))
}

#[async_trait]
impl Provider for ResolvingImages {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn model(&self) -> &str {
        self.inner.model()
    }

    fn accepts_images(&self) -> bool {
        self.inner.accepts_images()
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        match resolve_images(&self.store, request).await? {
            Some(resolved) => self.inner.stream(&resolved, cancel).await,
            None => self.inner.stream(request, cancel).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::{ScriptedProvider, ScriptedResponse};
    use keel_store::StoreOptions;

    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";

    fn with_image(uri: String) -> Message {
        let mut m = Message::user("what is this?");
        m.content.push(ContentPart::ImageRef {
            uri,
            mime_type: Some("image/png".into()),
        });
        m
    }

    #[tokio::test]
    async fn the_model_gets_the_stored_bytes_and_urls_unchanged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path().join("k.db"), StoreOptions::default()).expect("open");
        let stored = store.put_image(PNG.to_vec()).await.expect("put");
        let scripted = Arc::new(ScriptedProvider::new([ScriptedResponse::text("a cat")]));
        let provider = ResolvingImages::wrap(scripted.clone(), store);
        let stored_ref = with_image(keel_core::image_uri(&stored.sha256));
        let url = with_image("https://example.com/a.png".into());
        let request = ChatRequest::new([stored_ref.clone(), url.clone()]);
        provider
            .complete(&request, CancellationToken::new())
            .await
            .expect("complete");
        let sent = scripted.requests();
        let expected = format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(PNG)
        );
        assert_eq!(
            sent[0].messages[0].content[1],
            ContentPart::ImageRef {
                uri: expected,
                mime_type: Some("image/png".into())
            }
        );
        assert_eq!(*sent[0].messages[1], url, "a URL image passes through");
        assert_eq!(
            *request.messages[0], stored_ref,
            "the caller's request keeps the reference"
        );
    }

    #[tokio::test]
    async fn a_missing_image_fails_the_call_before_the_provider() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path().join("k.db"), StoreOptions::default()).expect("open");
        let scripted = Arc::new(ScriptedProvider::new([ScriptedResponse::text("never")]));
        let provider = ResolvingImages::wrap(scripted.clone(), store);
        let request = ChatRequest::new([with_image(keel_core::image_uri(&"0".repeat(64)))]);
        let err = provider
            .complete(&request, CancellationToken::new())
            .await
            .unwrap_err();
        insta::assert_snapshot!(err, @"provider unavailable: an image of the conversation is not stored");
        assert!(scripted.requests().is_empty());
    }
}
