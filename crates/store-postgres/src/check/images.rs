//! The check of images: every `keel-image:` reference of a stored or
//! queued message names a stored image, and every stored image's bytes
//! match their hash. (Images nobody refers to are not findings: nothing
//! collects them yet.)

use std::collections::{BTreeMap, HashSet};

use crate::store::Tx;
use keel_core::{stored_image_hash, ContentPart, Message};
use keel_store::{CheckOptions, Invariant, InvariantReport, Result};

use super::{rows, MAX_NAMED};
use crate::store::from_pg;
use crate::util::sha256_hex;

/// Image references without their image, and images whose bytes are not
/// their hash.
pub(super) async fn images(
    tx: &Tx<'_>,
    _: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    let mut refs: BTreeMap<String, String> = BTreeMap::new();
    let mut collect = |place: String, content: &str| {
        let Ok(message) = serde_json::from_str::<Message>(content) else {
            return;
        };
        for part in &message.content {
            if let ContentPart::ImageRef { uri, .. } = part {
                if let Some(hash) = stored_image_hash(uri) {
                    refs.entry(hash.to_owned()).or_insert_with(|| place.clone());
                }
            }
        }
    };
    for r in rows(
        tx,
        "SELECT timeline_id, seq, content FROM messages \
         WHERE role = 'user' AND content LIKE '%keel-image:%'",
    )
    .await?
    {
        let place = format!(
            "timeline {} seq {}",
            r.get::<_, String>(0),
            r.get::<_, i64>(1)
        );
        collect(place, &r.get::<_, String>(2));
    }
    for r in rows(tx, "SELECT turn_id, message FROM queued_inputs").await? {
        let place = format!("the queued input of turn {}", r.get::<_, String>(0));
        collect(place, &r.get::<_, String>(1));
    }
    let hashes: Vec<String> = refs.keys().cloned().collect();
    let stored: HashSet<String> = tx
        .query(
            "SELECT sha256 FROM images WHERE sha256 = ANY($1)",
            &[&hashes],
        )
        .await
        .map_err(from_pg)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for (hash, place) in refs
        .iter()
        .filter(|(hash, _)| !stored.contains(*hash))
        .take(MAX_NAMED)
    {
        report.push(
            Invariant::History,
            false,
            format!("{place} refers to image {hash}, which is not stored"),
        );
    }
    for r in rows(tx, "SELECT sha256, bytes FROM images ORDER BY sha256").await? {
        let (hash, bytes): (String, Vec<u8>) = (r.get(0), r.get(1));
        if sha256_hex(&bytes) != hash {
            report.push(
                Invariant::Integrity,
                false,
                format!("image {hash}'s bytes do not match their hash"),
            );
        }
    }
    Ok(())
}
