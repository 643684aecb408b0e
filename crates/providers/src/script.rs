//! Script files of keel's [`ScriptedProvider`]: YAML or JSON text (JSON is
//! YAML) parsed into a [`Script`], and the file loading behind
//! `providers.NAME.script` and `keel chat --script`. keel-core defines the
//! script and replays it; reading and parsing files happens here, at the
//! edge, so core does no I/O and needs no YAML parser.
//!
//! A script is either a plain list of responses (exhausted → error) or the
//! map form of [`Script`] (`responses`, `when_exhausted`).

use std::path::Path;

use keel_core::{Script, WhenExhausted};

/// Why a script could not be loaded. A narrow error of its own, apart from
/// [`ProviderConfigError`](crate::ProviderConfigError): `keel chat --script`
/// reports it as is, while a profile's `script` key wraps it with the key
/// path.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    /// The file could not be read.
    #[error("cannot read script {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The text is not a valid script.
    #[error("invalid script{}: {message}", path.as_ref().map(|p| format!(" {p}")).unwrap_or_default())]
    Invalid {
        /// The file, when loaded from one.
        path: Option<String>,
        /// What is wrong, with the location serde reported.
        message: String,
    },
}

/// Parses a script from YAML or JSON text.
pub fn parse_script(text: &str) -> Result<Script, ScriptError> {
    parse(text, None)
}

/// Reads and parses a script file (`.yaml`, `.yml` or `.json`).
pub fn load_script(path: &Path) -> Result<Script, ScriptError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ScriptError::Io {
        path: shown.clone(),
        source,
    })?;
    parse(&text, Some(shown))
}

fn parse(text: &str, path: Option<String>) -> Result<Script, ScriptError> {
    let invalid = |e: serde_yaml::Error| ScriptError::Invalid {
        path: path.clone(),
        message: e.to_string(),
    };
    let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(invalid)?;
    // Parse the text again as the chosen shape so errors keep their line.
    if value.is_sequence() {
        let responses = serde_yaml::from_str(text).map_err(invalid)?;
        Ok(Script {
            responses,
            when_exhausted: WhenExhausted::Error,
        })
    } else {
        serde_yaml::from_str(text).map_err(invalid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::ScriptedProvider;

    #[test]
    fn loads_yaml_and_json_and_reports_bad_scripts() {
        let yaml = "
- text: hello
- tool_calls:
    - name: current_time
- error: { kind: server, status: 503, message: busy }
";
        let script = parse_script(yaml).unwrap();
        assert_eq!(script.responses.len(), 3);
        assert_eq!(script.when_exhausted, WhenExhausted::Error);
        let json = r#"{"responses": [{"text": "hi", "delay_ms": 5}], "when_exhausted": "echo"}"#;
        let script = parse_script(json).unwrap();
        assert_eq!(script.responses.len(), 1);
        assert_eq!(script.when_exhausted, WhenExhausted::Echo);
        assert_eq!(ScriptedProvider::from_script(script).remaining(), 1);
        let errs: Vec<String> = ["- txt: typo", "- error: { kind: meltdown }", "responses: 3"]
            .iter()
            .map(|t| parse_script(t).err().unwrap().to_string())
            .collect();
        insta::assert_yaml_snapshot!(errs);
    }

    #[test]
    fn a_file_is_read_and_its_errors_name_it() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.yaml");
        std::fs::write(&good, "- text: hi\n- text: there\n").unwrap();
        assert_eq!(load_script(&good).unwrap().responses.len(), 2);
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "- txt: typo\n").unwrap();
        let err = load_script(&bad).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "invalid script {}: .[0]: unknown field `txt`",
                bad.display()
            )),
            "{err}"
        );
        let missing = dir.path().join("missing.yaml");
        let err = load_script(&missing).unwrap_err();
        assert!(matches!(err, ScriptError::Io { .. }), "{err}");
        assert!(
            err.to_string()
                .starts_with(&format!("cannot read script {}: ", missing.display())),
            "{err}"
        );
    }
}
