//! The check of images: every `keel-image:` reference of a stored or
//! queued message names a stored image, and every stored image's bytes
//! match their hash. (Images nobody refers to are not findings: nothing
//! collects them yet.)

use std::collections::BTreeMap;

use keel_core::{stored_image_hash, ContentPart, Message};
use rusqlite::Connection;

use super::{query_rows, CheckOptions, Invariant, InvariantReport};
use crate::error::Result;
use crate::util::sha256_hex;

/// Most missing images named.
const MAX_NAMED: usize = 20;

/// Image references without their image, and images whose bytes changed.
pub(super) fn images(
    conn: &Connection,
    _: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    // Where each missing image is referred to first: (hash → place).
    let mut refs: BTreeMap<String, String> = BTreeMap::new();
    let mut collect = |place: String, content: Result<String>| {
        // An unreadable message is the history check's finding.
        let Ok(message) = content.and_then(|c| {
            serde_json::from_str::<Message>(&c)
                .map_err(|e| crate::error::StoreError::corrupt("message", e.to_string()))
        }) else {
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
    // Only user messages carry images; a text row without `keel-image:`
    // has none (compressed rows are blobs, read whole).
    let mut stmt = conn.prepare(
        "SELECT timeline_id, seq, content FROM messages \
         WHERE role = 'user' AND (typeof(content) = 'blob' OR content LIKE '%keel-image:%')",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok((
            format!(
                "timeline {} seq {}",
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?
            ),
            crate::compress::unpack("messages.content", r.get_ref(2)?),
        ))
    })?;
    for row in rows {
        let (place, content) = row?;
        collect(place, content);
    }
    let queued = query_rows(conn, "SELECT turn_id, message FROM queued_inputs", |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
    })?;
    for (turn, message) in queued {
        collect(format!("the queued input of turn {turn}"), Ok(message));
    }
    let mut exists = conn.prepare("SELECT 1 FROM images WHERE sha256 = ?1")?;
    let mut named = 0;
    for (hash, place) in refs {
        if !exists.exists([&hash])? {
            named += 1;
            if named <= MAX_NAMED {
                report.push(
                    Invariant::History,
                    false,
                    format!("{place} refers to image {hash}, which is not stored"),
                );
            }
        }
    }
    let stored = query_rows(
        conn,
        "SELECT sha256, bytes FROM images ORDER BY sha256",
        |r| Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?)),
    )?;
    for (hash, bytes) in stored {
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
