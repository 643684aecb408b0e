//! Images of user messages, stored once by the SHA-256 of their bytes
//! (schema v17, migration 0017). Messages refer to them by
//! `keel-image:sha256:<hex>` URIs ([`keel_core::image_uri`]).

use keel_core::{is_sha256_hex_str, sniff_image};
use rusqlite::{params, OptionalExtension};

use crate::error::{Result, StoreError};
use crate::util::sha256_hex;
use crate::SqliteStore;

/// An image as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredImage {
    /// SHA-256 of the bytes, lowercase hex.
    pub sha256: String,
    /// The media type its magic bytes say (`image/png`, …).
    pub media_type: String,
    /// The bytes.
    pub bytes: Vec<u8>,
}

impl SqliteStore {
    pub(crate) async fn put_image(&self, bytes: Vec<u8>) -> Result<StoredImage> {
        let Some(media_type) = sniff_image(&bytes) else {
            return Err(StoreError::InvalidInput(
                "the bytes are not a PNG, JPEG, GIF or WebP image".into(),
            ));
        };
        let sha256 = sha256_hex(&bytes);
        let hash = sha256.clone();
        let size = i64::try_from(bytes.len())
            .map_err(|_| StoreError::InvalidInput("the image is too large".into()))?;
        let now = keel_core::time::now_ms();
        self.db
            .write(move |c| {
                c.prepare_cached(
                    "INSERT INTO images (sha256, media_type, byte_size, bytes, created_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (sha256) DO NOTHING",
                )?
                .execute(params![hash, media_type, size, bytes, now])?;
                Ok(())
            })
            .await?;
        Ok(StoredImage {
            sha256,
            media_type: media_type.to_owned(),
            bytes: Vec::new(),
        })
    }

    pub(crate) async fn image(&self, sha256: &str) -> Result<Option<StoredImage>> {
        if !is_sha256_hex_str(sha256) {
            return Ok(None);
        }
        let hash = sha256.to_owned();
        let row = self
            .db
            .read(move |c| {
                Ok(
                    c.prepare_cached("SELECT media_type, bytes FROM images WHERE sha256 = ?1")?
                        .query_row([&hash], |r| {
                            Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))
                        })
                        .optional()?,
                )
            })
            .await?;
        let Some((media_type, bytes)) = row else {
            return Ok(None);
        };
        if sha256_hex(&bytes) != sha256 {
            return Err(StoreError::corrupt(
                "images.bytes",
                format!("image {sha256}'s bytes do not match their hash"),
            ));
        }
        Ok(Some(StoredImage {
            sha256: sha256.to_owned(),
            media_type,
            bytes,
        }))
    }

    pub(crate) async fn missing_images(&self, hashes: Vec<String>) -> Result<Vec<String>> {
        self.db
            .read(move |c| {
                let mut stmt = c.prepare_cached("SELECT 1 FROM images WHERE sha256 = ?1")?;
                let mut missing = Vec::new();
                for h in &hashes {
                    if !stmt.exists([h])? {
                        missing.push(h.clone());
                    }
                }
                Ok(missing)
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SqliteStore, StoreOptions};

    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";

    fn open() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store =
            SqliteStore::open(dir.path().join("k.db"), StoreOptions::default()).expect("open");
        (dir, store)
    }

    #[tokio::test]
    async fn an_image_round_trips_by_hash_and_is_stored_once() {
        let (_dir, store) = open();
        let first = store.put_image(PNG.to_vec()).await.expect("put");
        assert_eq!(first.sha256, sha256_hex(PNG));
        assert_eq!(first.media_type, "image/png");
        let again = store.put_image(PNG.to_vec()).await.expect("put again");
        assert_eq!(again.sha256, first.sha256);
        let read = store
            .image(&first.sha256)
            .await
            .expect("read")
            .expect("stored");
        assert_eq!(read.bytes, PNG);
        assert_eq!(read.media_type, "image/png");
        let rows: i64 = store
            .db
            .read(|c| Ok(c.query_row("SELECT count(*) FROM images", [], |r| r.get(0))?))
            .await
            .expect("count");
        assert_eq!(rows, 1, "the same bytes are stored once");
        assert_eq!(store.image(&"0".repeat(64)).await.expect("read"), None);
        assert_eq!(store.image("not-a-hash").await.expect("read"), None);
        assert_eq!(
            store
                .missing_images(vec![first.sha256.clone(), "0".repeat(64)])
                .await
                .expect("missing"),
            vec!["0".repeat(64)]
        );
    }

    #[tokio::test]
    async fn unknown_bytes_are_refused_and_corrupt_ones_reported() {
        let (_dir, store) = open();
        let err = store.put_image(b"<svg/>".to_vec()).await.unwrap_err();
        assert!(matches!(err, StoreError::InvalidInput(_)), "{err}");
        let stored = store.put_image(PNG.to_vec()).await.expect("put");
        let hash = stored.sha256.clone();
        store
            .db
            .write(move |c| {
                c.execute(
                    "UPDATE images SET bytes = ?1 WHERE sha256 = ?2",
                    params![b"\x89PNG\r\n\x1a\n\0\0\0\rIHDX".to_vec(), hash],
                )?;
                Ok(())
            })
            .await
            .expect("damage");
        let err = store.image(&stored.sha256).await.unwrap_err();
        assert!(matches!(err, StoreError::Corruption(_)), "{err}");
    }
}
