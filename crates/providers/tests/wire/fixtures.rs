//! Recorded wire formats of both APIs, behind one [`Wire`] trait so the same
//! test list runs against each adapter.

use keel_core::Provider;
use keel_providers::{AnthropicProvider, HttpProviderConfig, OpenAiProvider, SleepFn};
use serde_json::json;

/// One adapter and its canned wire bodies. Every body streams the same
/// logical answers, so the tests can assert the same results.
pub trait Wire {
    /// Snapshot prefix.
    const NAME: &'static str;
    /// The variable auth errors must name.
    const KEY_ENV: &'static str;
    /// Path the adapter posts to.
    const PATH: &'static str;

    fn provider(config: HttpProviderConfig, sleep: SleepFn) -> Box<dyn Provider>;
    /// "Hello, world!" in two deltas; usage 11/3; finish stop.
    fn text() -> Vec<String>;
    /// "Checking." then read_file{"path":"README.md"} (call_a) and
    /// list_dir{"path":"src","depth":2} (call_b), arguments split in many
    /// deltas; usage 20/40; finish tool_calls.
    fn tool_calls() -> Vec<String>;
    /// Frames whose only output is the text delta "Hel".
    fn first_delta() -> Vec<String>;
    /// A frame that is not valid JSON.
    fn malformed() -> String;
    /// The body of a 401.
    fn unauthorized() -> String;
    /// "Hi" with usage numbers no counter can hold (above `u64::MAX`, negative).
    fn absurd_usage() -> Vec<String>;
    /// The body of the API's 400 for a request over the context window.
    fn context_overflow() -> String;
}

pub struct OpenAi;
pub struct Anthropic;

fn data(v: serde_json::Value) -> String {
    format!("data: {v}\n\n")
}

fn chunk(delta: serde_json::Value, finish: Option<&str>) -> String {
    data(json!({
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "model-x",
        "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
    }))
}

fn oa_call_start(index: u32, id: &str, name: &str) -> String {
    chunk(
        json!({ "tool_calls": [{ "index": index, "id": id, "type": "function",
                                 "function": { "name": name, "arguments": "" } }] }),
        None,
    )
}

fn oa_args(index: u32, fragment: &str) -> String {
    chunk(
        json!({ "tool_calls": [{ "index": index, "function": { "arguments": fragment } }] }),
        None,
    )
}

fn oa_usage(prompt: u64, completion: u64) -> String {
    data(json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [],
        "usage": { "prompt_tokens": prompt, "completion_tokens": completion,
                   "total_tokens": prompt + completion },
    }))
}

/// One frame split in two writes, to check SSE reassembly across chunks.
fn split(frame: String) -> [String; 2] {
    let mid = frame.len() / 2;
    [frame[..mid].to_owned(), frame[mid..].to_owned()]
}

impl Wire for OpenAi {
    const NAME: &'static str = "openai";
    const KEY_ENV: &'static str = "OPENAI_API_KEY";
    const PATH: &'static str = "/v1/chat/completions";

    fn provider(config: HttpProviderConfig, sleep: SleepFn) -> Box<dyn Provider> {
        Box::new(OpenAiProvider::new(config).unwrap().with_sleep(sleep))
    }

    fn text() -> Vec<String> {
        vec![
            chunk(json!({ "role": "assistant", "content": "" }), None),
            chunk(json!({ "content": "Hello" }), None),
            ": keep-alive comment\n\n".to_owned(),
            chunk(json!({ "content": ", world!" }), None),
            chunk(json!({}), Some("stop")),
            oa_usage(11, 3),
            "data: [DONE]\n\n".to_owned(),
        ]
    }

    fn tool_calls() -> Vec<String> {
        let mut frames = vec![
            chunk(json!({ "role": "assistant", "content": null }), None),
            chunk(json!({ "content": "Checking." }), None),
            oa_call_start(0, "call_a", "read_file"),
        ];
        for f in ["{\"pa", "th\": \"RE", "ADME", ".md\"}"] {
            frames.push(oa_args(0, f));
        }
        frames.push(oa_call_start(1, "call_b", "list_dir"));
        let [a, b] = split(oa_args(1, "{\"path\""));
        frames.extend([a, b]);
        for f in [": \"src\"", ", \"depth\"", ": 2}"] {
            frames.push(oa_args(1, f));
        }
        frames.push(chunk(json!({}), Some("tool_calls")));
        frames.push(oa_usage(20, 40));
        frames.push("data: [DONE]\n\n".to_owned());
        frames
    }

    fn first_delta() -> Vec<String> {
        vec![chunk(
            json!({ "role": "assistant", "content": "Hel" }),
            None,
        )]
    }

    fn malformed() -> String {
        "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"lo\"\n\n".to_owned()
    }

    fn unauthorized() -> String {
        json!({ "error": { "message": "Incorrect API key provided: sk-test.",
                           "type": "invalid_request_error", "code": "invalid_api_key" } })
        .to_string()
    }

    fn absurd_usage() -> Vec<String> {
        vec![
            chunk(json!({ "content": "Hi" }), None),
            chunk(json!({}), Some("stop")),
            "data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 1e30, \
             \"completion_tokens\": -4}}\n\n"
                .to_owned(),
            "data: [DONE]\n\n".to_owned(),
        ]
    }

    fn context_overflow() -> String {
        json!({ "error": { "message": "This model's maximum context length is 128000 tokens. \
                                        However, your messages resulted in 130000 tokens.",
                           "type": "invalid_request_error", "param": "messages",
                           "code": "context_length_exceeded" } })
        .to_string()
    }
}

fn event(name: &str, v: serde_json::Value) -> String {
    format!("event: {name}\ndata: {v}\n\n")
}

fn an_start(input: u64) -> String {
    event(
        "message_start",
        json!({ "type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "model": "model-x", "stop_reason": null, "stop_sequence": null,
            "usage": { "input_tokens": input, "output_tokens": 1 } } }),
    )
}

fn an_text_start(index: u32) -> String {
    event(
        "content_block_start",
        json!({ "type": "content_block_start", "index": index,
                "content_block": { "type": "text", "text": "" } }),
    )
}

fn an_text(index: u32, text: &str) -> String {
    event(
        "content_block_delta",
        json!({ "type": "content_block_delta", "index": index,
                "delta": { "type": "text_delta", "text": text } }),
    )
}

fn an_tool_start(index: u32, id: &str, name: &str) -> String {
    event(
        "content_block_start",
        json!({ "type": "content_block_start", "index": index,
                "content_block": { "type": "tool_use", "id": id, "name": name, "input": {} } }),
    )
}

fn an_json(index: u32, partial: &str) -> String {
    event(
        "content_block_delta",
        json!({ "type": "content_block_delta", "index": index,
                "delta": { "type": "input_json_delta", "partial_json": partial } }),
    )
}

fn an_stop(index: u32) -> String {
    event(
        "content_block_stop",
        json!({ "type": "content_block_stop", "index": index }),
    )
}

fn an_end(reason: &str, output: u64) -> [String; 2] {
    [
        event(
            "message_delta",
            json!({ "type": "message_delta",
                    "delta": { "stop_reason": reason, "stop_sequence": null },
                    "usage": { "output_tokens": output } }),
        ),
        event("message_stop", json!({ "type": "message_stop" })),
    ]
}

impl Wire for Anthropic {
    const NAME: &'static str = "anthropic";
    const KEY_ENV: &'static str = "ANTHROPIC_API_KEY";
    const PATH: &'static str = "/v1/messages";

    fn provider(config: HttpProviderConfig, sleep: SleepFn) -> Box<dyn Provider> {
        Box::new(AnthropicProvider::new(config).unwrap().with_sleep(sleep))
    }

    fn text() -> Vec<String> {
        let mut frames = vec![
            an_start(11),
            an_text_start(0),
            event("ping", json!({ "type": "ping" })),
            an_text(0, "Hello"),
            an_text(0, ", world!"),
            an_stop(0),
        ];
        frames.extend(an_end("end_turn", 3));
        frames
    }

    fn tool_calls() -> Vec<String> {
        let mut frames = vec![
            an_start(20),
            an_text_start(0),
            an_text(0, "Checking."),
            an_stop(0),
            an_tool_start(1, "call_a", "read_file"),
            an_json(1, ""),
        ];
        for f in ["{\"pa", "th\": \"RE", "ADME", ".md\"}"] {
            frames.push(an_json(1, f));
        }
        frames.push(an_stop(1));
        frames.push(an_tool_start(2, "call_b", "list_dir"));
        let [a, b] = split(an_json(2, "{\"path\""));
        frames.extend([a, b]);
        for f in [": \"src\"", ", \"depth\"", ": 2}"] {
            frames.push(an_json(2, f));
        }
        frames.push(an_stop(2));
        frames.extend(an_end("tool_use", 40));
        frames
    }

    fn first_delta() -> Vec<String> {
        vec![an_start(11), an_text_start(0), an_text(0, "Hel")]
    }

    fn malformed() -> String {
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":\n\n"
            .to_owned()
    }

    fn unauthorized() -> String {
        json!({ "type": "error",
                "error": { "type": "authentication_error", "message": "invalid x-api-key" } })
        .to_string()
    }

    fn absurd_usage() -> Vec<String> {
        let mut frames = vec![
            "event: message_start\ndata: {\"type\": \"message_start\", \"message\": \
             {\"id\": \"m\", \"usage\": {\"input_tokens\": 99999999999999999999999, \
             \"output_tokens\": 1}}}\n\n"
                .to_owned(),
            an_text_start(0),
            an_text(0, "Hi"),
            an_stop(0),
        ];
        frames.push(
            "event: message_delta\ndata: {\"type\": \"message_delta\", \"delta\": \
             {\"stop_reason\": \"end_turn\"}, \"usage\": {\"output_tokens\": -4}}\n\n"
                .to_owned(),
        );
        frames.push(event("message_stop", json!({ "type": "message_stop" })));
        frames
    }

    fn context_overflow() -> String {
        json!({ "type": "error",
                "error": { "type": "invalid_request_error",
                           "message": "prompt is too long: 210000 tokens > 200000 maximum" } })
        .to_string()
    }
}
