//! `keel export DIALOG [--out FILE]` and `keel import FILE`: one dialog as
//! a `keel.dialog` JSON file (docs/EXPORT.md), written from and recreated
//! in a data directory no other keel is running on.

use std::io::{Read, Write};
use std::path::Path;
use std::process::ExitCode;

use keel_core::SessionId;
use keel_engine::{DialogExport, MAX_DIALOG_EXPORT_BYTES};

use crate::app::App;
use crate::error::{io_err, AppError, Result};

/// Runs `keel export DIALOG`: the export goes to `out` (which must not
/// exist yet) or, without it, to stdout.
pub async fn export(
    config_file: Option<&Path>,
    data_dir: Option<&Path>,
    dialog: &str,
    out: Option<&Path>,
) -> Result<ExitCode> {
    let id = parse_dialog(dialog)?;
    let app = App::open("keel export", config_file, data_dir, None).await?;
    let record = app.manager.record(id).await?;
    if record.deleted_at_ms.is_some() {
        return Err(AppError::InvalidInput(format!("dialog {id} is deleted")));
    }
    let json = app.manager.export_dialog(id).await?.to_json()? + "\n";
    app.manager.shutdown();
    match out {
        None => std::io::stdout()
            .write_all(json.as_bytes())
            .map_err(io_err("writing the export to stdout"))?,
        Some(path) => {
            let context = format!("writing the export to {}", path.display());
            let mut file = std::fs::File::create_new(path).map_err(io_err(context.clone()))?;
            file.write_all(json.as_bytes())
                .and_then(|()| file.sync_all())
                .map_err(io_err(context))?;
            eprintln!(
                "exported dialog {id} \"{}\" to {}",
                record.title,
                path.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `keel import FILE`: the dialog it holds becomes a new dialog of its chat.
pub async fn import(
    config_file: Option<&Path>,
    data_dir: Option<&Path>,
    file: &Path,
) -> Result<ExitCode> {
    let export = DialogExport::from_json(&read_bounded(file)?)?;
    let app = App::open("keel import", config_file, data_dir, None).await?;
    let id = app.manager.import_dialog(export).await?;
    let record = app.manager.record(id).await?;
    app.manager.shutdown();
    println!(
        "imported {} as dialog {id} \"{}\" ({}:{}:{})",
        file.display(),
        record.title,
        record.channel,
        record.chat_id,
        record.dialog_id
    );
    Ok(ExitCode::SUCCESS)
}

fn parse_dialog(text: &str) -> Result<SessionId> {
    text.parse().map_err(|_| {
        AppError::InvalidInput(format!(
            "{text:?} is not a dialog id (the full id /api/dialogs and the web page show)"
        ))
    })
}

/// The file's bytes, refused beyond [`MAX_DIALOG_EXPORT_BYTES`] without reading them all.
fn read_bounded(file: &Path) -> Result<Vec<u8>> {
    let context = format!("reading {}", file.display());
    let handle = std::fs::File::open(file).map_err(io_err(context.clone()))?;
    let limit = u64::try_from(MAX_DIALOG_EXPORT_BYTES).unwrap_or(u64::MAX);
    let mut bytes = Vec::new();
    handle
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err(context))?;
    if bytes.len() > MAX_DIALOG_EXPORT_BYTES {
        return Err(AppError::InvalidInput(format!(
            "{} is larger than the {MAX_DIALOG_EXPORT_BYTES} bytes an import reads",
            file.display()
        )));
    }
    Ok(bytes)
}
