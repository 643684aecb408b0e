//! Images in `keel chat`: `/image PATH` stores an image and attaches it to
//! the next message.

use super::Chat;

impl Chat {
    /// `/image PATH`: stores the file's image and attaches it to the next
    /// message (the image is committed before any message refers to it).
    pub(super) async fn attach_image(&mut self, path: &str) {
        match self.manager.accepts_images(self.current).await {
            Ok(true) => {}
            Ok(false) => {
                return self.say(
                    "error: this dialog's model takes text only (its profile has images = false)",
                )
            }
            Err(e) => return self.say(&format!("error: {e}")),
        }
        let max = crate::config::DEFAULT_IMAGE_MAX_BYTES;
        let bytes = match tokio::fs::read(path).await {
            Ok(b) if b.len() as u64 > max => {
                return self.say(&format!("error: {path} is larger than {max} bytes"))
            }
            Ok(b) => b,
            Err(e) => return self.say(&format!("error: cannot read {path}: {e}")),
        };
        match self.manager.store().put_image(bytes).await {
            Ok(image) => {
                self.images.push(keel_core::ContentPart::ImageRef {
                    uri: keel_core::image_uri(&image.sha256),
                    mime_type: Some(image.media_type.clone()),
                });
                self.say(&format!(
                    "(attached {path} ({}); {} image(s) go with your next message)",
                    image.media_type,
                    self.images.len()
                ));
            }
            Err(e) => self.say(&format!("error: {path}: {e}")),
        }
    }
}
