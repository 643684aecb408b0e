//! `server.allowed_origins`: the origins, besides the server's own, whose
//! pages may use the API (checked by the server's origin middleware).

use axum::http::uri::Authority;

/// An origin allowed to use the API besides the server's own, as
/// `scheme://host[:port]` in lower case; its host is accepted in `Host`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AllowedOrigin {
    origin: String,
    host: String,
}

impl AllowedOrigin {
    /// Parses `text`, an `http` or `https` origin with no path; says what is wrong otherwise.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!("{text:?} is not an origin ({why}); write scheme://host[:port], as https://keel.example.com")
        };
        let origin = text.to_ascii_lowercase();
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .ok_or_else(|| bad("the scheme must be http or https"))?;
        if authority.is_empty() || authority.contains(['/', '?', '#', '@']) {
            return Err(bad("only a host and a port may follow the scheme"));
        }
        let host = host_of(authority).ok_or_else(|| bad("the host is not valid"))?;
        Ok(Self { origin, host })
    }

    /// The origin, `scheme://host[:port]` in lower case.
    pub fn as_str(&self) -> &str {
        &self.origin
    }

    /// Its host, as [`host_of`] reads a `Host` header.
    pub(crate) fn host(&self) -> &str {
        &self.host
    }
}

impl TryFrom<String> for AllowedOrigin {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        Self::parse(&text)
    }
}

impl From<AllowedOrigin> for String {
    fn from(origin: AllowedOrigin) -> String {
        origin.origin
    }
}

/// The host of a `Host` header value (`host[:port]`), lower-cased;
/// IPv6 addresses keep their brackets.
pub(crate) fn host_of(authority: &str) -> Option<String> {
    let parsed: Authority = authority.parse().ok()?;
    if parsed.as_str().contains('@') {
        return None;
    }
    Some(parsed.host().to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_origins_must_be_bare_http_origins() {
        let out: Vec<String> = [
            "https://Keel.Example.com",
            "http://[::1]:8080",
            "https://keel.example.com/",
            "https://keel.example.com/app",
            "ftp://keel.example.com",
            "keel.example.com",
            "https://",
            "https://user@keel.example.com",
            "https://keel example.com",
        ]
        .iter()
        .map(|t| match AllowedOrigin::parse(t) {
            Ok(o) => format!("{t}: ok {} (host {})", o.origin, o.host),
            Err(e) => format!("{t}: {e}"),
        })
        .collect();
        insta::assert_snapshot!(out.join("\n"));
    }
}
