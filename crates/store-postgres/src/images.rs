//! Images of user messages on PostgreSQL, stored once by the SHA-256 of
//! their bytes; messages refer to them by `keel-image:sha256:<hex>` URIs
//! ([`keel_core::image_uri`]).

use keel_core::{is_sha256_hex_str, sniff_image};
use keel_store::{Result, StoreError, StoredImage};

use crate::store::from_pg;
use crate::util::sha256_hex;
use crate::PgStore;

impl PgStore {
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
        let bytes = std::sync::Arc::new(bytes);
        self.write(move |tx| {
            let (hash, bytes) = (hash.clone(), bytes.clone());
            Box::pin(async move {
                tx.execute(
                    "INSERT INTO images (sha256, media_type, byte_size, bytes, created_at) \
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT (sha256) DO NOTHING",
                    &[&hash, &media_type, &size, &bytes.as_slice(), &now],
                )
                .await
                .map_err(from_pg)?;
                Ok(())
            })
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
            .read(move |tx| {
                let hash = hash.clone();
                Box::pin(async move {
                    Ok(tx
                        .query_opt(
                            "SELECT media_type, bytes FROM images WHERE sha256 = $1",
                            &[&hash],
                        )
                        .await
                        .map_err(from_pg)?
                        .map(|r| (r.get::<_, String>(0), r.get::<_, Vec<u8>>(1))))
                })
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
        self.read(move |tx| {
            let hashes = hashes.clone();
            Box::pin(async move {
                // One read; the answer keeps the caller's order (and repeats).
                let rows = tx
                    .query(
                        "SELECT u.h FROM unnest($1::text[]) WITH ORDINALITY AS u(h, n) \
                         WHERE NOT EXISTS (SELECT 1 FROM images WHERE sha256 = u.h) \
                         ORDER BY u.n",
                        &[&hashes],
                    )
                    .await
                    .map_err(from_pg)?;
                Ok(rows.iter().map(|r| r.get(0)).collect())
            })
        })
        .await
    }
}
