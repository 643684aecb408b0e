//! Images: stored once by the SHA-256 of their bytes, read back by hash,
//! anything but a PNG, JPEG, GIF or WebP refused.
#![allow(missing_docs)] // a test's name is its documentation

use crate::StoreError;

use super::TestDb;

const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";

pub async fn an_image_round_trips_by_hash_and_unknown_bytes_are_refused(db: TestDb) {
    let store = db.store.clone();
    let first = store.put_image(PNG.to_vec()).await.unwrap();
    assert_eq!(first.media_type, "image/png");
    assert_eq!(first.sha256.len(), 64);
    assert!(
        first.bytes.is_empty(),
        "put answers the hash, not the bytes"
    );
    let again = store.put_image(PNG.to_vec()).await.unwrap();
    assert_eq!(again.sha256, first.sha256);
    let read = store.image(&first.sha256).await.unwrap().unwrap();
    assert_eq!(read.bytes, PNG);
    assert_eq!(read.media_type, "image/png");
    assert_eq!(store.image(&"0".repeat(64)).await.unwrap(), None);
    assert_eq!(store.image("not-a-hash").await.unwrap(), None);
    // Missing ones in the caller's order, repeats included.
    let zeros = "0".repeat(64);
    let ones = "1".repeat(64);
    assert_eq!(
        store
            .missing_images(vec![
                ones.clone(),
                first.sha256.clone(),
                zeros.clone(),
                ones.clone()
            ])
            .await
            .unwrap(),
        vec![ones.clone(), zeros, ones]
    );
    let err = store.put_image(b"<svg/>".to_vec()).await.unwrap_err();
    assert!(matches!(err, StoreError::InvalidInput(_)), "{err}");
}
