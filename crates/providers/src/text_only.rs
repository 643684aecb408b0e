//! A text-only model (a profile with `images = false`): it says it takes
//! no images, and refuses a request that carries one before any call.

use std::sync::Arc;

use async_trait::async_trait;
use keel_core::{
    CancellationToken, ChatRequest, ContentPart, Provider, ProviderError, ProviderStream,
};

/// A provider marked text-only by its profile.
pub struct TextOnly {
    profile: String,
    inner: Arc<dyn Provider>,
}

impl TextOnly {
    /// `inner` of profile `profile`, marked text-only.
    pub fn wrap(profile: &str, inner: Arc<dyn Provider>) -> Arc<dyn Provider> {
        Arc::new(Self {
            profile: profile.to_owned(),
            inner,
        })
    }
}

#[async_trait]
impl Provider for TextOnly {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn model(&self) -> &str {
        self.inner.model()
    }

    fn accepts_images(&self) -> bool {
        false
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        let has_image = request.messages.iter().any(|m| {
            m.content
                .iter()
                .any(|p| matches!(p, ContentPart::ImageRef { .. }))
        });
        if has_image {
            return Err(ProviderError::BadRequest {
                status: 400,
                message: format!(
                    "profile {:?} is text-only (images = false); the conversation has images",
                    self.profile
                ),
            });
        }
        self.inner.stream(request, cancel).await
    }
}
