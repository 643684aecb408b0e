"""The official clients against a live `keel serve`.

`cargo xtask ci` starts `keel serve` on tests/interop/fixture (the scripted
model of script.yaml, then the offline echo) and runs this file with
KEEL_URL and KEEL_TOKEN set. The checks run in the order below: the first
AG-UI run takes the scripted answers, every later model call is the echo.

- `openai` (the official Python package): models, completions streamed and
  not, three turns resending the whole history leave six messages in the
  dialog (read through keel's own API), an edited history forks, and a
  wrong key, a malformed request and an unknown model raise the client's
  own exceptions.
- `ag-ui-protocol`: a run's input is built with its RunAgentInput model;
  every event keel emits parses with its Event models; the stream keeps the
  protocol's ordering rules; a gated call ends a run with an interrupt
  outcome and a resume entry decides it; a bad input is a 4xx whose body
  is a RUN_ERROR.
- images: an OpenAI user message with `image_url` parts (a data URL and an
  https URL) and an AG-UI user message with an `image` part are stored as
  keel image parts and served back by `/api/images/{sha256}`.
"""

import base64
import json
import os
import sys
import traceback
import urllib.error
import urllib.request
import uuid

import openai
from ag_ui.core import (
    AssistantMessage,
    ImageInputContent,
    InputContentDataSource,
    Event,
    EventType,
    FunctionCall,
    RunAgentInput,
    ResumeEntry,
    RunErrorEvent,
    RunFinishedInterruptOutcome,
    RunFinishedSuccessOutcome,
    TextInputContent,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from pydantic import TypeAdapter

URL = os.environ["KEEL_URL"].rstrip("/")
TOKEN = os.environ["KEEL_TOKEN"]
EVENT = TypeAdapter(Event)


def keel_api(path):
    """GET a path of keel's native API."""
    request = urllib.request.Request(URL + path, headers={"authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)


def dialogs(channel, chat):
    return [d["id"] for d in keel_api(f"/api/dialogs?channel={channel}&chat_id={chat}")["items"]]


def dialog_messages(dialog):
    return keel_api(f"/api/dialogs/{dialog}/messages?limit=200")["items"]


def image_bytes(path):
    """The bytes keel serves at an image path of its API."""
    request = urllib.request.Request(URL + path, headers={"authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["content-type"] == "image/png", r.headers
        return r.read()


# The smallest bytes keel reads as a PNG (its signature and IHDR's start).
PNG = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x01"


def client(key=TOKEN):
    return openai.OpenAI(base_url=URL + "/v1", api_key=key, max_retries=0, timeout=60)


# ── AG-UI ────────────────────────────────────────────────────────────────


def agui_post(body, path="/ag-ui"):
    """POSTs a run input; returns (status, parsed events) or (status, error body)."""
    request = urllib.request.Request(
        URL + path,
        data=body.encode(),
        headers={
            "authorization": f"Bearer {TOKEN}",
            "content-type": "application/json",
            "accept": "text/event-stream",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream"), r.headers
            events = []
            for line in r:
                line = line.decode().rstrip("\n")
                if line.startswith("data: "):
                    events.append(EVENT.validate_json(line[len("data: "):]))
            return r.status, events
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def check_order(events, earlier=()):
    """AG-UI's ordering rules on one run's stream (`earlier`: the calls of the
    interrupted run this one resumes, which it may answer)."""
    assert events and events[0].type == EventType.RUN_STARTED, events[:1]
    ends = [i for i, e in enumerate(events) if e.type in (EventType.RUN_FINISHED, EventType.RUN_ERROR)]
    assert ends == [len(events) - 1], f"one RUN_FINISHED or RUN_ERROR, last: {ends}"
    messages, calls, steps = {}, {c: "ended" for c in earlier}, set()
    for e in events:
        t = e.type
        if t == EventType.TEXT_MESSAGE_START:
            assert e.message_id not in messages, e
            messages[e.message_id] = "open"
        elif t == EventType.TEXT_MESSAGE_CONTENT:
            assert messages.get(e.message_id) == "open", f"content outside START..END: {e}"
        elif t == EventType.TEXT_MESSAGE_END:
            assert messages.get(e.message_id) == "open", e
            messages[e.message_id] = "closed"
        elif t == EventType.TOOL_CALL_START:
            assert e.tool_call_id not in calls, e
            calls[e.tool_call_id] = "started"
        elif t == EventType.TOOL_CALL_ARGS:
            assert calls.get(e.tool_call_id) == "started", e
        elif t == EventType.TOOL_CALL_END:
            assert calls.get(e.tool_call_id) == "started", e
            calls[e.tool_call_id] = "ended"
        elif t == EventType.TOOL_CALL_RESULT:
            assert calls.get(e.tool_call_id) == "ended", e
            calls[e.tool_call_id] = "answered"
        elif t == EventType.STEP_STARTED:
            assert e.step_name not in steps, e
            steps.add(e.step_name)
        elif t == EventType.STEP_FINISHED:
            assert e.step_name in steps, e
            steps.remove(e.step_name)
        elif t == EventType.RUN_FINISHED:
            assert not steps, f"steps left open: {steps}"
            assert all(s == "closed" for s in messages.values()), messages
            assert all(s in ("ended", "answered") for s in calls.values()), calls
            waiting = set()
            if e.outcome is not None and e.outcome.type == "interrupt":
                waiting = {i.tool_call_id for i in e.outcome.interrupts}
            unanswered = {c for c, s in calls.items() if s != "answered"}
            assert unanswered == waiting, f"keel answers its own calls, or asks about them: {calls}"


def run_input(thread, messages, resume=None):
    return RunAgentInput(
        thread_id=thread,
        run_id=str(uuid.uuid4()),
        protocol_version="1.0",
        state={},
        messages=messages,
        tools=[],
        context=[],
        forwarded_props={},
        resume=resume,
    ).model_dump_json(by_alias=True)


def history_of(events, sent):
    """What an AG-UI client holds after a run: what it sent, then the
    assistant messages (with their tool calls) and tool results streamed."""
    held = list(sent)
    texts, calls, order = {}, {}, []
    for e in events:
        if e.type == EventType.TEXT_MESSAGE_START:
            texts[e.message_id] = ""
            order.append(("text", e.message_id))
        elif e.type == EventType.TEXT_MESSAGE_CONTENT:
            texts[e.message_id] += e.delta
        elif e.type == EventType.TOOL_CALL_START:
            calls[e.tool_call_id] = {"name": e.tool_call_name, "args": "", "parent": e.parent_message_id}
            order.append(("call", e.tool_call_id))
        elif e.type == EventType.TOOL_CALL_ARGS:
            calls[e.tool_call_id]["args"] += e.delta
        elif e.type == EventType.TOOL_CALL_RESULT:
            order.append(("result", e))
    for kind, item in order:
        if kind == "text":
            held.append(AssistantMessage(id=item, content=texts[item]))
        elif kind == "call":
            call = calls[item]
            held.append(
                AssistantMessage(
                    id=f"calls-{item}",
                    tool_calls=[ToolCall(id=item, function=FunctionCall(name=call["name"], arguments=call["args"]))],
                )
            )
        else:
            held.append(ToolMessage(id=item.message_id, tool_call_id=item.tool_call_id, content=item.content))
    return held


def agui_tools_sub_agents_and_order():
    """The scripted run: steps, text, keel's tool calls, a sub-agent run."""
    thread = "py-thread"
    sent = [UserMessage(id="u1", content="Research the launch.")]
    status, events = agui_post(run_input(thread, sent))
    assert status == 200, events
    check_order(events)
    kinds = [e.type for e in events]
    for needed in (
        EventType.STEP_STARTED,
        EventType.STEP_FINISHED,
        EventType.TEXT_MESSAGE_START,
        EventType.TEXT_MESSAGE_CONTENT,
        EventType.TEXT_MESSAGE_END,
        EventType.TOOL_CALL_START,
        EventType.TOOL_CALL_ARGS,
        EventType.TOOL_CALL_END,
        EventType.TOOL_CALL_RESULT,
        EventType.ACTIVITY_SNAPSHOT,
    ):
        assert needed in kinds, f"no {needed.value} in {[k.value for k in kinds]}"
    names = [e.tool_call_name for e in events if e.type == EventType.TOOL_CALL_START]
    assert names == ["current_time", "delegate"], names
    steps = [e.step_name for e in events if e.type == EventType.STEP_STARTED]
    assert steps == ["model_call_1", "model_call_2", "model_call_3"], steps
    runs = [e.content for e in events if e.type == EventType.ACTIVITY_SNAPSHOT]
    assert runs[-1]["agent"] == "researcher" and runs[-1]["status"] == "completed", runs
    finished = events[-1]
    assert finished.type == EventType.RUN_FINISHED and finished.usage[0].total_tokens > 0, finished
    text = "".join(e.delta for e in events if e.type == EventType.TEXT_MESSAGE_CONTENT)
    assert text == "Let me check the time first. The researcher found three launch notes.", text
    dialog = events[0].metadata["keel"]["dialogId"]

    # The client's whole history resent (its tool calls and results too):
    # the same dialog goes on, nothing is duplicated.
    held = history_of(events, sent) + [UserMessage(id="u2", content="Thanks.")]
    status, events = agui_post(run_input(thread, held))
    assert status == 200, events
    check_order(events)
    assert events[0].metadata["keel"]["dialogId"] == dialog
    users = [m for m in dialog_messages(dialog) if m["role"] == "user"]
    assert [m["text"] for m in users] == ["Research the launch.", "Thanks."], users


def agui_interrupt_and_resume():
    """A gated write_file ends the run with an interrupt (the official types
    parse it); a resume entry denies it and the run is the continuation, in
    which the model read the reason."""
    thread = "py-hitl"
    sent = [UserMessage(id="u1", content="Write the plan.")]
    status, events = agui_post(run_input(thread, sent))
    assert status == 200, events
    check_order(events)
    finished = events[-1]
    assert finished.type == EventType.RUN_FINISHED and isinstance(finished.outcome, RunFinishedInterruptOutcome), finished
    [interrupt] = finished.outcome.interrupts
    [call] = [e for e in events if e.type == EventType.TOOL_CALL_START]
    assert call.tool_call_name == "write_file" and interrupt.tool_call_id == call.tool_call_id, (call, interrupt)
    assert interrupt.reason == "tool_approval" and interrupt.response_schema["required"] == ["decision"], interrupt
    assert interrupt.metadata["keel"]["arguments"] == {"path": "plan.md", "content": "Launch on Monday."}, interrupt
    dialog = events[0].metadata["keel"]["dialogId"]
    [pending] = keel_api(f"/api/dialogs/{dialog}/approvals")["items"]
    assert pending["id"] == interrupt.id and pending["status"] == "pending", pending

    answer = [
        ResumeEntry(interrupt_id=interrupt.id, status="resolved", payload={"decision": "deny", "reason": "not today"})
    ]
    resume = run_input(thread, history_of(events, sent), resume=answer)
    status, events = agui_post(resume)
    assert status == 200, events
    check_order(events, earlier=[call.tool_call_id])
    assert events[0].metadata["keel"]["turnOrigin"] == "agent_continuation", events[0]
    [result] = [e for e in events if e.type == EventType.TOOL_CALL_RESULT]
    assert result.tool_call_id == call.tool_call_id and "(reason: not today)" in result.content, result
    text = "".join(e.delta for e in events if e.type == EventType.TEXT_MESSAGE_CONTENT)
    assert text == "I did not write plan.md.", text
    assert isinstance(events[-1].outcome, RunFinishedSuccessOutcome), events[-1]
    [decided] = keel_api(f"/api/dialogs/{dialog}/approvals?status=all")["items"]
    assert decided["status"] == "denied" and decided["reason"] == "not today", decided
    status, error = agui_post(resume)
    assert status == 409 and RunErrorEvent.model_validate(error).code == "conflict", (status, error)


def agui_bad_input():
    for body in ["{", json.dumps({"threadId": "t", "runId": "r", "messages": []})]:
        status, error = agui_post(body)
        assert status == 400, (status, error)
        parsed = RunErrorEvent.model_validate(error)
        assert parsed.type == EventType.RUN_ERROR and parsed.message, parsed
    status, error = agui_post(run_input("t", [UserMessage(id="1", content="x")]), path="/ag-ui/nobody")
    assert status == 404 and RunErrorEvent.model_validate(error).code == "not_found", error
    assert dialogs("ag-ui", "t") == []


def agui_image_part():
    data = base64.b64encode(PNG).decode()
    content = [
        TextInputContent(text="What is in it?"),
        ImageInputContent(source=InputContentDataSource(value=data, mime_type="image/png")),
    ]
    status, events = agui_post(run_input("t-image", [UserMessage(id="1", content=content)]))
    assert status == 200, (status, events)
    assert events[-1].type == EventType.RUN_FINISHED, events[-1:]
    [dialog] = dialogs("ag-ui", "t-image")
    [first] = [m for m in dialog_messages(dialog) if m["role"] == "user"]
    assert first["text"] == "What is in it?", first
    assert [i["mime_type"] for i in first["images"]] == ["image/png"], first
    assert image_bytes(first["images"][0]["url"]) == PNG


# ── OpenAI ───────────────────────────────────────────────────────────────


def openai_models():
    ids = [m.id for m in client().models.list()]
    assert ids == ["keel:root", "keel:researcher"], ids
    assert client().models.retrieve("keel:researcher").owned_by == "keel"


def openai_completion_and_stream():
    c = client()
    r = c.chat.completions.create(
        model="keel:root",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}],
        user="py-once",
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant", r
    assert '"Hello."' in choice.message.content, choice.message.content
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens > 0, r.usage
    assert r.model == "keel:root"

    chunks = list(
        c.chat.completions.create(
            model="keel:root",
            messages=[{"role": "user", "content": "Stream it."}],
            stream=True,
            stream_options={"include_usage": True},
            user="py-stream",
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert '"Stream it."' in text, text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["stop"], finishes
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0, chunks[-1]
    assert len({ch.id for ch in chunks}) == 1


def openai_three_turns_leave_six_messages():
    c = client()
    history = [{"role": "system", "content": "Be brief."}]
    for text in ["One.", "Two.", "Three."]:
        history.append({"role": "user", "content": text})
        r = c.chat.completions.create(model="keel:root", messages=history, user="py-three")
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    [dialog] = dialogs("openai", "py-three")
    kept = dialog_messages(dialog)
    assert len(kept) == 6, kept
    assert [m["role"] for m in kept] == ["user", "assistant"] * 3, kept
    assert r.model_extra["keel"]["dialog_id"] == dialog


def openai_edited_history_forks():
    c = client()
    history = []
    for text in ["First.", "Second."]:
        history.append({"role": "user", "content": text})
        r = c.chat.completions.create(model="keel:root", messages=history, user="py-edit")
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    [original] = dialogs("openai", "py-edit")
    edited = history[:2] + [{"role": "user", "content": "Second, edited."}]
    r = c.chat.completions.create(model="keel:root", messages=edited, user="py-edit")
    keel = r.model_extra["keel"]
    assert keel["forked_from"] == original and keel["dialog_id"] != original, keel
    assert len(dialog_messages(original)) == 4
    forked = [m["text"] for m in dialog_messages(keel["dialog_id"])]
    assert forked[:2] == [m["text"] for m in dialog_messages(original)[:2]]
    assert forked[2] == "Second, edited.", forked
    assert sorted(dialogs("openai", "py-edit")) == sorted([original, keel["dialog_id"]])


def openai_image_url_parts():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    content = [
        {"type": "text", "text": "Describe it."},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]
    r = client().chat.completions.create(
        model="keel:root", messages=[{"role": "user", "content": content}], user="py-image"
    )
    assert r.choices[0].finish_reason == "stop", r
    [dialog] = dialogs("openai", "py-image")
    [first] = [m for m in dialog_messages(dialog) if m["role"] == "user"]
    assert first["text"] == "Describe it.", first
    assert [i["url"] for i in first["images"]][1] == "https://example.com/cat.png", first
    assert image_bytes(first["images"][0]["url"]) == PNG
    try:
        client().chat.completions.create(
            model="keel:root",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,PHN2Zz4="}}]}],
            user="py-image-bad",
        )
    except openai.BadRequestError:
        pass
    else:
        raise AssertionError("an SVG claimed to be a PNG was accepted")


def openai_errors_raise_the_clients_exceptions():
    def raises(exception, call):
        try:
            call()
        except exception:
            return
        raise AssertionError(f"expected {exception.__name__}")

    ok = [{"role": "user", "content": "Hi."}]
    raises(openai.AuthenticationError, lambda: client("wrong").chat.completions.create(model="keel:root", messages=ok))
    raises(openai.AuthenticationError, lambda: client("wrong").models.list())
    raises(openai.BadRequestError, lambda: client().chat.completions.create(model="keel:root", messages=[]))
    raises(
        openai.BadRequestError,
        lambda: client().chat.completions.create(
            model="keel:root", messages=[{"role": "tool", "content": "x", "tool_call_id": "c"}, *ok]
        ),
    )
    raises(openai.NotFoundError, lambda: client().chat.completions.create(model="gpt-4o", messages=ok, user="py-err"))
    raises(openai.NotFoundError, lambda: client().models.retrieve("keel:nobody"))
    assert dialogs("openai", "py-err") == []


CHECKS = [
    agui_tools_sub_agents_and_order,  # first: it takes the scripted answers
    agui_interrupt_and_resume,  # second: it takes the scripted answers left
    agui_bad_input,
    openai_models,
    openai_completion_and_stream,
    openai_three_turns_leave_six_messages,
    openai_edited_history_forks,
    openai_errors_raise_the_clients_exceptions,
    openai_image_url_parts,
    agui_image_part,
]


def main():
    print(f"interop: openai {openai.__version__}, ag-ui-protocol, against {URL}")
    failed = 0
    for check in CHECKS:
        try:
            check()
            print(f"interop: ok    {check.__name__}")
        except Exception:
            failed += 1
            print(f"interop: FAIL  {check.__name__}")
            traceback.print_exc()
    print(f"interop: {len(CHECKS) - failed} of {len(CHECKS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
