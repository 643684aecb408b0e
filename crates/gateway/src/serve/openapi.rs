//! The OpenAPI 3.1 document of `keel serve`, generated from the handlers'
//! annotations and the wire types (a snapshot test keeps it reviewed). The
//! WebSocket frames are in its schemas too, for client generators.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Ref, RefOr, Response, ResponseBuilder};
use utoipa::{IntoResponses, Modify, OpenApi};

use super::api;
use super::frames;
use super::images;
use super::problem::{Problem, PROBLEM_JSON};
use super::routes::{approvals, dialogs, exports, mcp_servers, runs, system, webhooks};
use super::sse;

/// The error answers every route documents (each a problem body).
pub(crate) struct Errors;

impl IntoResponses for Errors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        let problem = |what: &str| {
            ResponseBuilder::new()
                .description(what)
                .content(
                    PROBLEM_JSON,
                    utoipa::openapi::ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("Problem")))
                        .build(),
                )
                .build()
                .into()
        };
        [
            (
                "400",
                "Malformed request: bad JSON, a wrong type, an unknown field, a bad id or value",
            ),
            ("401", "No valid bearer token"),
            (
                "403",
                "The Host or Origin header names another site (see server.allowed_origins)",
            ),
            ("404", "No such dialog, checkpoint, run or route"),
            ("405", "Method not allowed"),
            ("409", "Conflicts with the current state"),
            ("413", "Body or text too large"),
            ("415", "Body is not application/json"),
            (
                "422",
                "Agent definitions are invalid (reload); every problem is listed",
            ),
            ("503", "Shutting down, or storage busy: retry"),
        ]
        .into_iter()
        .map(|(code, what)| (code.to_owned(), problem(what)))
        .collect()
    }
}

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "keel",
        description = "keel's HTTP API. Every route but the probes /api/health and /api/ready \
            needs `Authorization: Bearer <token>` when the server has a token. Errors are application/problem+json. The WebSocket at \
            /api/ws speaks the ClientFrame and ServerFrame schemas (see docs/PROTOCOL.md)."
    ),
    paths(
        system::health, system::ready, system::openapi, system::reload, system::metrics,
        dialogs::list, dialogs::create, dialogs::get_one, dialogs::update, dialogs::delete,
        dialogs::messages, dialogs::send, sse::stream, dialogs::stop, dialogs::steer, dialogs::usage,
        dialogs::checkpoints, dialogs::rollback, dialogs::fork, exports::export, exports::import,
        runs::list, runs::get_one, runs::events, runs::dialog_events, runs::dialog_inbox,
        runs::cancel, runs::trace, runs::turn_trace, approvals::list, approvals::decide,
        mcp_servers::list, webhooks::list, images::get_image,
    ),
    components(schemas(Problem, frames::ClientFrame, frames::ServerFrame, api::Order)),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags(
        (name = "dialogs", description = "Dialogs, their messages and turns"),
        (name = "checkpoints", description = "Checkpoints, rollback and fork"),
        (name = "agent-runs", description = "Sub-agent runs and their events"),
        (name = "system", description = "Health, readiness, the contract, catalog reload"),
        (name = "webhooks", description = "The outbox of signed webhook deliveries"),
    )
)]
struct ApiDoc;

static DOCUMENT: LazyLock<String> = LazyLock::new(|| {
    ApiDoc::openapi().to_pretty_json().unwrap_or_else(|e| {
        format!("{{\"error\": \"the OpenAPI document does not serialize: {e}\"}}")
    })
});

/// The OpenAPI document, as served at `/api/openapi.json`.
pub fn openapi_json() -> &'static str {
    &DOCUMENT
}
