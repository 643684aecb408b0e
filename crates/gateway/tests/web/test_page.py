#!/usr/bin/env python3
"""Browser test of keel's web page, run by `cargo xtask ci`.

It starts the real `keel serve` binary on an ephemeral loopback port, with
the scripted models of fixture/ (deterministic answers for the root agent
and each sub-agent), and drives Debian's Chromium headless through
Playwright for Python. Each scenario asserts what a user would see and
writes a screenshot under --out.

    python3 crates/gateway/tests/web/test_page.py --keel target/debug/keel \
        --out target/web-screenshots

Exit status 0 when every scenario passed; otherwise the failing scenario,
the page's console and the server's log are printed and the status is 1.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from playwright.sync_api import expect, sync_playwright

HERE = pathlib.Path(__file__).resolve().parent
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 20_000
TOKEN = "s3cret-browser-token"


class Server:
    """A `keel serve` process on a data directory."""

    def __init__(self, keel, data_dir):
        self.keel = keel
        self.data_dir = data_dir
        self.proc = None
        self.port = None
        self.log = []

    def start(self, port=0, token=None):
        env = dict(os.environ)
        env.pop("KEEL_TOKEN", None)
        if token:
            env["KEEL_TOKEN"] = token
        env.setdefault("KEEL_LOG", "warn")
        self.proc = subprocess.Popen(
            [self.keel, "serve", "--data-dir", str(self.data_dir), "--bind", f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(30):
            self.stop()
            raise RuntimeError("keel serve did not start:\n" + "\n".join(self.log))
        return f"http://127.0.0.1:{self.port}/"

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class Run:
    """The page under test and what it has shown."""

    def __init__(self, page, out, server):
        self.page = page
        self.out = out
        self.server = server
        self.console = []
        self.dialogs = []
        self.shots = []
        self.blocked_in_sanitizer = 0
        page.on("console", self.on_console)
        page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
        page.on("dialog", self.on_dialog)

    def on_console(self, message):
        source = message.location.get("url", "")
        # DOMPurify parses untrusted HTML in an inert document; Chromium
        # reports the inline handlers it meets there as CSP violations
        # (blocked) before DOMPurify drops them. Those are expected.
        if source.endswith("/vendor/purify.min.js") and "Content Security Policy" in message.text:
            self.blocked_in_sanitizer += 1
            return
        self.console.append(f"{message.type}: {message.text} ({source})")

    def on_dialog(self, dialog):
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def shot(self, name):
        path = self.out / f"{len(self.shots) + 1:02d}-{name}.png"
        self.page.screenshot(path=str(path))
        self.shots.append(path)

    def send(self, text):
        box = self.page.locator("#input")
        box.fill(text)
        box.press("Enter")

    def assistant(self, nth=-1):
        return self.page.locator("article.msg.assistant").nth(nth)

    def errors(self):
        """Script errors and CSP reports of the page itself. Failed requests
        are left out: the reconnect and token scenarios cause them on
        purpose, and an unexpected one fails an expectation anyway."""
        network = ("error: Failed to load resource", "error: WebSocket connection to")
        return [c for c in self.console
                if c.startswith(("error", "pageerror")) and not c.startswith(network)]


# ── scenarios ───────────────────────────────────────────────────────────────


def scenario_first_load(r):
    """The page loads, connects, and offers an empty conversation."""
    page = r.page
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    expect(page.locator("#empty")).to_be_visible()
    expect(page.locator("#input")).to_be_focused()
    r.shot("empty")


def scenario_streamed_answer(r):
    """Enter sends; the answer streams in (seen part-way) and is saved."""
    page = r.page
    r.send("Hello")
    expect(page.locator("article.msg.user").first).to_contain_text("Hello")
    streaming = page.locator("article.msg.assistant.streaming .md")
    expect(streaming).to_contain_text("Hello! I am")
    partial = streaming.inner_text()
    assert "watch it arrive" not in partial, f"the whole answer came at once: {partial!r}"
    r.shot("streaming")
    expect(page.locator("article.msg.assistant.streaming")).to_have_count(0)
    expect(r.assistant()).to_contain_text("so you can watch it arrive.")
    # The dialog exists, is listed, and its automatic title arrives live.
    expect(page.locator("#dialog-title")).to_have_text("Launch planning")
    expect(page.locator(".dialog-link[aria-current=page]")).to_contain_text("Launch planning")
    expect(page.locator("#counters")).to_contain_text("calls")
    expect(page.locator("#timeline li.checkpoint")).to_have_count(1)
    r.shot("answer")


def scenario_shift_enter(r):
    """Shift+Enter adds a line instead of sending."""
    box = r.page.locator("#input")
    box.fill("first line")
    box.press("Shift+Enter")
    box.type("second line")
    assert box.input_value() == "first line\nsecond line", box.input_value()
    expect(r.page.locator("article.msg.user")).to_have_count(1)
    box.fill("")


def scenario_xss_is_inert(r):
    """Model output with script, handlers and javascript: links renders as inert text."""
    page = r.page
    r.send("Show me something tricky")
    answer = r.assistant()
    expect(answer).to_contain_text("hover me")
    expect(page.locator("article.msg.assistant.streaming")).to_have_count(0)
    body = answer.locator(".md").first
    expect(body.locator("strong")).to_have_text("bold")
    expect(body.locator("a", has_text="good link")).to_have_attribute("href", "https://example.com/docs")
    expect(body.locator("a", has_text="good link")).to_have_attribute("rel", re.compile("noopener"))
    for selector in ["script", "iframe", "svg", "form", "button", "[onerror]", "[onclick]", "[onload]", "[onmouseover]", "[style]"]:
        assert body.locator(selector).count() == 0, f"{selector} survived sanitizing"
    hrefs = body.locator("a").evaluate_all("els => els.map(a => a.getAttribute('href'))")
    assert not any(h and h.strip().lower().startswith("javascript:") for h in hrefs), hrefs
    # Hover and click what the payload targeted: nothing may run.
    body.locator("p", has_text="hover me").hover()
    body.locator("p", has_text="hover me").click()
    for link in ["bad link", "raw anchor"]:
        anchor = body.locator("a", has_text=link)
        if anchor.count():
            anchor.click()
    page.wait_for_timeout(300)
    assert page.evaluate("window.__xss") is None, f"injected code ran: {page.evaluate('window.__xss')}"
    assert r.dialogs == [], f"dialogs fired: {r.dialogs}"
    assert len(page.context.pages) == 1, "a link opened a window"
    r.shot("xss-inert")


def scenario_rollback(r):
    """Rollback moves the timeline to an older checkpoint; the abandoned branch stays listed, greyed."""
    page = r.page
    timeline = page.locator("#timeline li.checkpoint")
    expect(timeline).to_have_count(2)
    first = page.locator("#timeline li.checkpoint", has_text="Turn 1")
    first.get_by_role("button", name=re.compile("^Roll back")).click()
    expect(timeline).to_have_count(3)
    abandoned = page.locator("#timeline li.checkpoint.abandoned")
    expect(abandoned).to_have_count(1)
    expect(abandoned).to_contain_text("Turn 2")
    expect(page.locator("#timeline li.checkpoint.head")).to_contain_text("rollback")
    # The history follows the branch: the tricky answer is gone from the chat.
    expect(page.locator("article.msg.assistant")).to_have_count(1)
    expect(page.locator("#messages")).not_to_contain_text("hover me")
    r.shot("rollback")


def scenario_stop_with_escape(r):
    """Esc stops a running turn; nothing of its answer is saved, the message is kept and marked unanswered."""
    page = r.page
    r.send("Tell me slowly")
    expect(page.locator("#stop")).to_be_visible()
    expect(page.locator("article.msg.assistant.streaming .md")).to_contain_text("This answer")
    expect(page.locator("#send")).to_have_text(re.compile("Steer|Queue"))
    r.shot("running")
    page.keyboard.press("Escape")
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator("article.msg.user").last).to_have_class(re.compile("unanswered"))
    expect(page.locator("article.msg.user").last).to_contain_text("unanswered")
    expect(page.locator("article.msg.assistant").last).to_contain_text("your message is kept, unanswered")
    r.shot("stopped")


def scenario_steer(r):
    """Typing while a turn runs steers it: the model reads it and answers it in the same turn."""
    page = r.page
    r.send("What should we weigh?")
    expect(page.locator("article.msg.assistant.streaming .md")).to_contain_text("Let me think")
    expect(page.locator("#send")).to_have_text("Steer")
    r.send("Put the schema first")
    steer = page.locator("article.msg.user", has_text="Put the schema first")
    expect(steer.locator(".tag", has_text="steer")).to_be_visible()
    r.shot("steering")
    expect(r.assistant()).to_contain_text("Got it: the schema comes first.")
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator("article.msg.assistant.streaming")).to_have_count(0)
    # One turn, saved in order: the question, the first answer, the steer
    # the model read, and its answer to it.
    texts = [t.split("\n")[0] for t in page.locator("article.msg").all_inner_texts()[-4:]]
    assert texts == [
        "What should we weigh?",
        "Let me think about the launch: there are several things to weigh here, one at a time.",
        "Put the schema first",
        "Got it: the schema comes first.",
    ], texts


def scenario_delegation(r):
    """A delegation shows three runs, live: a slow foreground one is cancelled
    from the tree, and the background one turns completed without a reload."""
    page = r.page
    page.evaluate("window.__samePage = true")
    r.send("Plan the launch with the team")
    researcher = page.locator("#run-tree li.run[data-agent=researcher]")
    writer = page.locator("#run-tree li.run[data-agent=writer]")
    expect(researcher).to_have_attribute("data-status", "running")
    expect(writer).to_have_attribute("data-status", "completed")
    expect(page.locator("#stop")).to_be_visible()
    r.shot("runs-foreground")
    researcher.get_by_role("button", name=re.compile("^Cancel")).click()
    expect(researcher).to_have_attribute("data-status", "cancelled")
    runs = page.locator("#run-tree li.run")
    expect(runs).to_have_count(3)
    archivist = page.locator("#run-tree li.run[data-agent=archivist]")
    expect(archivist).to_have_attribute("data-mode", "background")
    expect(archivist).to_have_attribute("data-status", re.compile("queued|running"))
    expect(archivist.get_by_role("button", name=re.compile("^Cancel"))).to_be_visible()
    expect(page.locator("#run-tree .group-line")).to_contain_text("batch of 2")
    # The turn's own answer (the signal's continuation may already follow it).
    answer = page.locator("article.msg.assistant:not([data-origin=agent_continuation])").last
    expect(answer).to_contain_text("files the decisions in the background")
    # Tool calls show as collapsible lines.
    tool = page.locator("details.tool", has_text="delegate").first
    expect(tool).to_be_visible()
    tool.locator("summary").click()
    expect(tool.locator(".tool-output")).to_be_visible()
    r.shot("runs-running")
    expect(archivist).to_have_attribute("data-status", "completed", timeout=TIMEOUT_MS)
    expect(archivist.get_by_role("button", name=re.compile("^Cancel"))).to_have_count(0)
    expect(archivist.locator(".run-tokens")).to_contain_text("tok")
    expect(page.locator("#counters")).to_contain_text("sub-agents")
    assert page.evaluate("window.__samePage") is True, "the page reloaded"
    # What it reported is delivered by continuation turns that stream in
    # live, and the inbox moves each event from pending to delivered.
    continuation = page.locator("article.msg.assistant[data-origin=agent_continuation]")
    expect(continuation.first.locator(".turn-label")).to_have_text("Background results arrived")
    expect(page.locator("#inbox .inbox-list li[data-status=consumed]", has_text="completion of archivist")).to_have_count(1)
    events = page.locator("#inbox .inbox-list li").count()
    expect_inbox(page, pending=0, delivered=events)
    expect(continuation.last).to_contain_text(re.compile("archivist (reports back|has filed today.s decisions)"))
    expect(page.locator("article.msg.assistant.streaming")).to_have_count(0)
    r.shot("runs-completed")
    # The archivist's signal is a card: severity, summary and the run.
    card = page.locator("#signals li.signal")
    expect(card).to_have_count(1)
    expect(card).to_have_attribute("data-severity", "warning")
    expect(card.locator(".signal-summary")).to_have_text("Two launch decisions contradict each other")
    expect(card.locator(".signal-run")).to_contain_text("archivist")
    r.shot("signal-card")


def scenario_trace_waterfall(r):
    """A run's Trace button opens its waterfall with its model calls; the
    turn's trace shows the turn, its own model and tool calls and its three
    runs as bars; an answer's Trace button opens its turn's; HTML in a
    delegated task stays text."""
    page = r.page
    writer = page.locator("#run-tree li.run[data-agent=writer]")
    writer.locator(".run-line").get_by_role("button", name=re.compile("^Trace")).click()
    dialog = page.locator("#trace-dialog")
    expect(dialog).to_be_visible()
    rows = dialog.locator(".waterfall li.trace-row")
    expect(dialog.locator(".trace-row[data-kind=run]")).to_have_count(1)
    expect(rows.first).to_have_attribute("data-status", "completed")
    expect(dialog.locator(".trace-row[data-kind=model]").first).to_be_visible()
    dialog.get_by_role("button", name="Whole turn").click()
    expect(dialog.locator("#trace-title")).to_contain_text("turn")
    # The turn, its calls, and its runs: the batch of two and the background run.
    expect(dialog.locator(".trace-row[data-kind=run]")).to_have_count(3)
    expect(rows.first).to_have_attribute("data-kind", "turn")
    expect(dialog.locator(".trace-row[data-kind=model]").first).to_be_visible()
    delegate = dialog.locator(".trace-row[data-kind=tool]").first
    expect(delegate).to_be_visible()
    expect(delegate.locator(".trace-call-id")).not_to_be_empty()
    for agent in ["researcher", "writer", "archivist"]:
        expect(dialog.locator(".trace-row[data-kind=run] .trace-name", has_text=agent)).to_have_count(1)
    expect(dialog.locator(".trace-row[data-status=cancelled]")).to_have_count(1)
    calls = dialog.locator(".trace-row[data-kind=model], .trace-row[data-kind=tool]").count()
    widths = dialog.locator("[data-role=bar]").evaluate_all(
        "els => els.map(e => e.getBoundingClientRect().width)")
    assert len(widths) == 3 + calls and all(w > 0 for w in widths), widths
    task = dialog.locator(".trace-task", has_text="<img src=x")
    expect(task).to_have_count(1)
    assert dialog.locator("img, [onerror]").count() == 0, "the task became an element"
    assert page.evaluate("window.__xss") is None, "a task's HTML ran"
    r.shot("trace-waterfall")
    dialog.get_by_role("button", name="Close").click()
    expect(dialog).to_be_hidden()
    # An answer committed live carries a Trace button for its turn.
    page.locator("article.msg.assistant .trace-turn").last.click()
    expect(dialog).to_be_visible()
    expect(rows.first).to_have_attribute("data-kind", "turn")
    expect(dialog.locator(".trace-row[data-kind=model]").first).to_be_visible()
    names = dialog.locator(".trace-name").evaluate_all("els => els.map(e => e.children.length)")
    assert all(n == 0 for n in names), "a span name holds elements"
    dialog.get_by_role("button", name="Close").click()
    expect(dialog).to_be_hidden()


def scenario_jump_to_latest(r):
    """What arrives while the reader is further up does not move the view;
    a button offers to jump to it, and from there the view follows again."""
    page = r.page
    messages = page.locator("#messages")
    # A short window, so the conversation is longer than what it shows.
    page.set_viewport_size({"width": 1400, "height": 560})
    r.send("Sum up the day")
    streaming = page.locator("article.msg.assistant.streaming")
    expect(streaming.locator(".md")).to_contain_text("The day in short")
    expect(page.locator("#jump")).to_be_hidden()
    messages.evaluate("el => el.scrollTo(0, 0)")
    expect(page.locator("#jump")).to_be_visible()
    assert messages.evaluate("el => el.scrollTop") == 0, "an arriving delta moved the view"
    r.shot("jump-offered")
    page.locator("#jump").click()
    expect(page.locator("#jump")).to_be_hidden()
    expect(streaming).to_have_count(0)
    expect(r.assistant()).to_contain_text("filed for tomorrow.")
    expect(r.assistant()).to_be_in_viewport()
    page.set_viewport_size({"width": 1400, "height": 860})


INBOX_COUNTS = """() => Object.fromEntries([...document.querySelectorAll('#inbox .inbox-stat')]
  .map((el) => [el.dataset.key, Number(el.querySelector('.inbox-n').textContent)]))"""


def expect_inbox(page, pending, delivered, dead_lettered=0):
    """The inbox shows these counts (the server's, which the page re-reads)."""
    want = {"pending": pending, "delivered": delivered, "dead_lettered": dead_lettered}
    try:
        page.wait_for_function(
            f"""() => {{ const c = ({INBOX_COUNTS})(), w = {want!r};
                return Object.keys(w).every((k) => c[k] === w[k]); }}""".replace("'", '"'))
    except Exception:
        raise AssertionError(f"inbox {page.evaluate(INBOX_COUNTS)}, expected {want}") from None


UNLABELLED_CONTROLS = """() => [...document.querySelectorAll('button, input, textarea, select, a[href], summary')]
  .filter((el) => el.getClientRects().length > 0)
  .filter((el) => {
    const labels = [...(el.labels ?? [])].map((l) => l.textContent).join('');
    const name = el.getAttribute('aria-label') || labels || el.textContent || el.getAttribute('title') || '';
    return name.trim() === '';
  })
  .map((el) => el.outerHTML.slice(0, 120))"""


def scenario_reload_restores(r):
    """A reload shows the same dialog: title, history, runs, timeline; every control has a name."""
    page = r.page
    before = page.locator("article.msg").count()
    page.reload()
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    expect(page.locator("#dialog-title")).to_have_text("Launch planning")
    expect(page.locator("article.msg")).to_have_count(before)
    expect(page.locator("#run-tree li.run")).to_have_count(3)
    expect(page.locator("#run-tree li.run[data-agent=archivist]")).to_have_attribute("data-status", "completed")
    expect(page.locator("#timeline li.checkpoint.abandoned")).to_have_count(1)
    # The stopped turn's message was kept by the server, marked unanswered,
    # and nothing of its answer was.
    kept = page.locator("article.msg.user", has_text="Tell me slowly")
    expect(kept).to_have_class(re.compile("unanswered"))
    expect(kept.locator(".tag", has_text="unanswered")).to_be_visible()
    expect(page.locator("#messages")).not_to_contain_text("This answer takes its time")
    expect_inbox(page, pending=0, delivered=page.locator("#inbox .inbox-list li").count())
    expect(page.locator("article.msg.assistant[data-origin=agent_continuation] .turn-label").first).to_be_visible()
    expect(page.locator("#signals li.signal[data-status=consumed]")).to_have_count(1)
    unlabelled = page.evaluate(UNLABELLED_CONTROLS)
    assert unlabelled == [], f"controls without an accessible name: {unlabelled}"
    r.shot("reloaded")


def scenario_dialogs(r):
    """New, rename, switch and delete dialogs."""
    page = r.page
    page.get_by_role("button", name="New dialog", exact=True).click()
    expect(page.locator(".dialog-link")).to_have_count(2)
    expect(page.locator("#empty")).to_be_visible()
    page.locator(".dialog-actions").get_by_role("button", name="Rename").click()
    page.locator("#rename-input").fill("Scratch pad")
    page.locator("#rename-input").press("Enter")
    expect(page.locator("#dialog-title")).to_have_text("Scratch pad")
    expect(page.locator(".dialog-link[aria-current=page]")).to_contain_text("Scratch pad")
    # The header's agent picker switches the dialog's agent, stored by the server.
    picker = page.get_by_label("Agent of this dialog")
    expect(picker).to_have_value("root")
    expect(picker.locator("option")).to_have_count(4)
    picker.select_option("writer")
    expect(picker).to_have_value("writer")
    page.locator(".dialog-link", has_text="Launch planning").click()
    expect(page.locator("#dialog-title")).to_have_text("Launch planning")
    expect(picker).to_have_value("root")
    expect(page.locator("#run-tree li.run")).to_have_count(3)
    page.locator(".dialog-link", has_text="Scratch pad").click()
    expect(page.locator("#dialog-title")).to_have_text("Scratch pad")
    expect(picker).to_have_value("writer")
    page.locator(".dialog-actions").get_by_role("button", name="Delete").click()
    page.locator("#confirm-ok").click()
    expect(page.locator(".dialog-link")).to_have_count(1)
    expect(page.locator("#dialog-title")).to_have_text("Launch planning")
    r.shot("dialogs")


def scenario_fork(r):
    """Fork starts a new dialog at a checkpoint, with the history up to it."""
    page = r.page
    page.locator("#timeline").get_by_role("button", name=re.compile(r"^Fork a new dialog from Turn 1 \(")).click()
    expect(page.locator(".dialog-link")).to_have_count(2)
    expect(page.locator("#dialog-title")).not_to_have_text("Launch planning")
    expect(page.locator("article.msg")).to_have_count(2)
    texts = [t.split("\n")[0] for t in page.locator("article.msg").all_inner_texts()]
    assert texts == [
        "Hello",
        "Hello! I am keel's scripted model. This answer streams in word by word, so you can watch it arrive.",
    ], texts
    expect(page.locator("#timeline li.checkpoint.head")).to_contain_text("Forked at turn 1")
    # Its parent is in the other dialog: no edge leads down to it.
    expect(page.locator("#timeline .graph path.edge")).to_have_count(0)
    expect(page.locator("#run-tree li.run")).to_have_count(0)
    r.shot("forked")
    page.locator(".dialog-actions").get_by_role("button", name="Delete").click()
    page.locator("#confirm-ok").click()
    expect(page.locator(".dialog-link")).to_have_count(1)
    expect(page.locator("#dialog-title")).to_have_text("Launch planning")


def scenario_narrow_screen(r):
    """At 375 px wide nothing overflows and the panels open from buttons."""
    page = r.page
    page.set_viewport_size({"width": 375, "height": 812})
    expect(page.locator("#toggle-dialogs")).to_be_visible()
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 375, f"the page is {width}px wide at 375px"
    expect(page.locator("#input")).to_be_visible()
    r.shot("narrow")
    page.get_by_role("button", name="Show runs and checkpoints").click()
    expect(page.locator("#activity")).to_be_in_viewport()
    r.shot("narrow-activity")
    page.keyboard.press("Escape")
    page.get_by_role("button", name="Show dialogs").click()
    expect(page.locator("#sidebar")).to_be_in_viewport()
    r.shot("narrow-dialogs")
    page.keyboard.press("Escape")
    page.set_viewport_size({"width": 1400, "height": 860})


def scenario_reconnect(r):
    """When the server goes away a banner says so; when it is back the page re-reads and goes on."""
    page = r.page
    port = r.server.port
    messages = page.locator("article.msg").count()
    r.server.stop()
    expect(page.locator("#banner")).to_be_visible()
    expect(page.locator("#banner")).to_contain_text("dropped")
    expect(page.locator("#connection")).to_have_attribute("data-state", re.compile("closed|connecting"))
    r.shot("reconnecting")
    r.server.start(port=port)
    expect(page.locator("#banner")).to_be_hidden(timeout=TIMEOUT_MS)
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    expect(page.locator("article.msg")).to_have_count(messages)
    expect(page.locator("#run-tree li.run")).to_have_count(3)


RESUMED_ANSWER = ("This answer keeps streaming while the page reloads and then carries on from "
                  "where it was without losing or repeating a single word of it until the very last one.")

# Records every text the streaming answer shows, from now on.
WATCH_STREAMING = """() => {
  window.__streamed = [];
  new MutationObserver(() => {
    const md = document.querySelector('article.msg.assistant.streaming .md');
    if (md) window.__streamed.push(md.textContent.trim());
  }).observe(document.getElementById('messages'), { subtree: true, childList: true, characterData: true });
}"""


def scenario_reload_mid_answer(r):
    """A reload in the middle of a streamed answer rejoins it: the answer goes on from
    where it was, to the end, no word repeated or missing."""
    page = r.page
    r.send("Stream it across a reload")
    streaming = page.locator("article.msg.assistant.streaming .md")
    expect(streaming).to_contain_text("while the page reloads")
    page.reload()
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    page.evaluate(WATCH_STREAMING)
    # Joined mid-answer: what streamed before the reload is shown again.
    expect(streaming).to_contain_text("This answer keeps streaming")
    r.shot("rejoined")
    expect(page.locator("article.msg.assistant.streaming")).to_have_count(0)
    expect(r.assistant().locator(".md")).to_have_text(RESUMED_ANSWER)
    seen = page.evaluate("window.__streamed")
    assert seen, "nothing streamed after the reload"
    assert all(RESUMED_ANSWER.startswith(t) for t in seen), \
        f"a streamed text is not a prefix of the answer: {[t for t in seen if not RESUMED_ANSWER.startswith(t)][:1]}"
    assert max(seen, key=len) == RESUMED_ANSWER, f"the stream ended at {max(seen, key=len)!r}"


def scenario_token_prompt(r):
    """A server with a token: the page asks for it, refuses a wrong one, keeps the right one for the tab."""
    page = r.page
    port = r.server.port
    r.server.stop()
    r.server.start(port=port, token=TOKEN)
    page.reload()
    expect(page.locator("#token-dialog")).to_be_visible()
    page.locator("#token-input").fill("wrong")
    page.locator("#token-input").press("Enter")
    expect(page.locator("#token-error")).to_be_visible()
    r.shot("token-prompt")
    page.locator("#token-input").fill(TOKEN)
    page.locator("#token-input").press("Enter")
    expect(page.locator("#token-dialog")).to_be_hidden()
    expect(page.locator("#dialog-title")).to_have_text("Launch planning")
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    assert page.evaluate("sessionStorage.getItem('keel.token')") == TOKEN
    page.reload()
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    expect(page.locator("#token-dialog")).to_be_hidden()


def scenario_approval_card(r):
    """A gated write_file shows an approval card, live and after a reload, with
    its HTML arguments as inert text; a refused decision shows the server's
    detail; Approve runs the call and the model's continuation streams in;
    Deny with a reason does not run it, the model reads the reason, and the
    call's line says it was denied; the turns after a decision are labelled
    so, not as background results."""
    page = r.page
    with tempfile.TemporaryDirectory(prefix="keel-web-approval-") as tmp:
        data = pathlib.Path(tmp) / "data"
        shutil.copytree(HERE / "approval-fixture", data)
        workspace = pathlib.Path(tmp) / "workspace"
        workspace.mkdir()
        server = Server(r.server.keel, data)
        try:
            page.goto(server.start())
            expect(page.locator("#connection")).to_have_attribute("data-state", "open")
            expect(page.locator("#approvals")).to_be_hidden()
            r.send("Write the launch notes")
            card = page.locator("#approvals .approval")
            expect(card).to_have_count(1)
            expect(card.locator(".approval-tool")).to_have_text("write_file")
            expect(card.locator(".approval-who")).to_have_text("asked by root")
            args = card.locator("pre.approval-args")
            expect(args).to_contain_text('"content": "<img src=x onerror=alert(1)> launch notes"')
            expect(args).to_be_visible()
            assert json.loads(args.inner_text()) == {
                "path": "notes.html", "content": "<img src=x onerror=alert(1)> launch notes"}
            for selector in ["#approvals img", "#messages img", "[onerror]"]:
                assert page.locator(selector).count() == 0, f"{selector} was created from the arguments"
            for name in ["Approve", "Always", "Deny"]:
                expect(card.get_by_role("button", name=name, exact=True)).to_be_enabled()
            r.shot("approval-card")

            # A decision the server refuses shows its detail, and the card stays.
            def refuse(route):
                if route.request.method != "POST":
                    return route.fallback()
                return route.fulfill(status=409, content_type="application/problem+json", body=json.dumps(
                    {"type": "about:blank", "status": 409, "code": "conflict", "title": "Conflict",
                     "detail": "approval was already decided: denied"}))
            page.route("**/api/approvals/*", refuse)
            card.get_by_role("button", name="Approve", exact=True).click()
            expect(card.locator(".approval-problem")).to_have_text("Not decided: approval was already decided: denied")
            expect(card).to_have_attribute("data-state", "stale")
            page.unroute("**/api/approvals/*", refuse)
            r.shot("approval-refused")

            # A reload shows the card again, from the pending list.
            page.reload()
            expect(page.locator("#connection")).to_have_attribute("data-state", "open")
            expect(card).to_have_count(1)
            expect(card).to_have_attribute("data-state", "pending")
            expect(card.locator("pre.approval-args")).to_contain_text("<img src=x onerror=alert(1)>")
            assert page.locator("#approvals img").count() == 0

            card.get_by_role("button", name="Approve", exact=True).click()
            expect(card).to_have_count(0)
            expect(page.locator("#approvals")).to_be_hidden()
            continuation = page.locator("article.msg.assistant[data-origin=agent_continuation]")
            expect(continuation.locator(".md")).to_contain_text("I wrote notes.html")
            expect(page.locator("article.msg.assistant.streaming")).to_have_count(0)
            expect(continuation.locator(".md")).to_contain_text("it is in the workspace now.")
            # It goes on after a decision, not after background results.
            expect(continuation.first.locator(".turn-label")).to_have_text("Approval decided")
            # The call's result is in the history, shown on its tool line.
            tool = page.locator("details.tool[data-state=ok]", has_text="write_file")
            expect(tool).to_have_count(1)
            expect(tool.locator(".tool-output")).to_contain_text("notes.html")
            expect(tool.locator(".tool-output")).not_to_contain_text("error")
            assert page.locator("#messages img").count() == 0
            written = workspace / "notes.html"
            assert written.is_file(), f"{written} is missing; the tool said {tool.locator('.tool-output').text_content()!r}"
            assert written.read_text() == "<img src=x onerror=alert(1)> launch notes", written
            r.shot("approval-approved")

            # Deny, with a reason: the call does not run, the model reads why.
            r.send("Write the other file too")
            expect(card).to_have_count(1)
            expect(card.locator("pre.approval-args")).to_contain_text('"path": "other.html"')
            expect(page.locator("details.tool[data-state=waiting]", has_text="other.html")).to_have_count(1)
            card.get_by_label("Reason to deny write_file").fill("not <b>now</b>")
            card.get_by_role("button", name="Deny", exact=True).click()
            expect(card).to_have_count(0)
            expect(continuation.last.locator(".md")).to_have_text("Understood: I left other.html alone.")
            denied = page.locator("details.tool", has_text="other.html")
            expect(denied.locator(".tool-output")).to_contain_text("not <b>now</b>")
            # The denied call's line says so: it did not run, it is not "done".
            expect(denied).to_have_attribute("data-state", "error")
            expect(denied.locator(".tool-state")).to_have_text("denied")
            expect(continuation.last.locator(".turn-label")).to_have_text("Approval decided")
            assert page.locator("#messages b, #approvals b, #messages script").count() == 0
            assert not (workspace / "other.html").exists(), "a denied call ran"
            assert r.dialogs == [], f"dialogs fired: {r.dialogs}"
            r.shot("approval-denied")
        finally:
            server.stop()


PASTE_PNG = """() => {
    const bytes = Uint8Array.from(atob('iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=='), (c) => c.charCodeAt(0));
    const data = new DataTransfer();
    data.items.add(new File([bytes], 'dot.png', { type: 'image/png' }));
    const input = document.getElementById('input');
    input.dispatchEvent(new ClipboardEvent('paste', { clipboardData: data, bubbles: true, cancelable: true }));
}"""


def scenario_image_paste(r):
    """A pasted image is previewed, removable, and leaves the composer when the message is sent."""
    page = r.page
    page.evaluate(PASTE_PNG)
    previews = page.locator("#attachments .attachment")
    expect(previews).to_have_count(1)
    previews.first.get_by_role("button", name="Remove this image").click()
    expect(previews).to_have_count(0)
    expect(page.locator("#attachments")).to_be_hidden()
    page.evaluate(PASTE_PNG)
    expect(previews).to_have_count(1)
    r.send("What is in this picture?")
    expect(previews).to_have_count(0)
    expect(page.locator("#attachments")).to_be_hidden()
    expect(page.locator("article.msg.user", has_text="What is in this picture?")).to_have_count(1)
    # Once answered (token_prompt restarted the server, so its script is at
    # its first answer again), the history read after a reload shows the
    # stored image: the dialog is one an earlier process served.
    expect(page.locator("article.msg.assistant:not(.streaming)", has_text="This answer streams in word by word")).to_have_count(1)
    page.reload()
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    image = page.locator("article.msg.user", has_text="What is in this picture?").locator("img.msg-image")
    expect(image).to_have_count(1)
    expect(image).to_have_attribute("src", re.compile(r"^data:image/png;base64,"))
    r.shot("image")


SCENARIOS = [
    scenario_first_load,
    scenario_streamed_answer,
    scenario_shift_enter,
    scenario_xss_is_inert,
    scenario_rollback,
    scenario_stop_with_escape,
    scenario_steer,
    scenario_jump_to_latest,
    scenario_delegation,
    scenario_trace_waterfall,
    scenario_reload_restores,
    scenario_dialogs,
    scenario_fork,
    scenario_narrow_screen,
    scenario_reload_mid_answer,
    scenario_reconnect,
    scenario_token_prompt,
    scenario_image_paste,
    scenario_approval_card,
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keel", required=True, help="the keel binary")
    parser.add_argument("--out", required=True, help="directory for screenshots")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    expect.set_options(timeout=TIMEOUT_MS)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="keel-web-") as tmp:
        data = pathlib.Path(tmp) / "data"
        shutil.copytree(HERE / "fixture", data)
        server = Server(args.keel, data)
        base = server.start()
        failed = None
        try:
            with sync_playwright() as p:
                context = p.chromium.launch_persistent_context(
                    str(pathlib.Path(tmp) / "profile"),
                    executable_path=args.chromium,
                    headless=True,
                    args=CHROMIUM_ARGS,
                    viewport={"width": 1400, "height": 860},
                    # No transitions: screenshots show panels where they end up.
                    reduced_motion="reduce",
                )
                page = context.pages[0] if context.pages else context.new_page()
                page.set_default_timeout(TIMEOUT_MS)
                run = Run(page, out, server)
                page.goto(base)
                for scenario in SCENARIOS:
                    name = scenario.__name__.removeprefix("scenario_")
                    t0 = time.monotonic()
                    try:
                        scenario(run)
                    except Exception:  # noqa: BLE001 — reported below with context
                        failed = name
                        run.shot(f"FAILED-{name}")
                        print(f"web: {name} FAILED", flush=True)
                        traceback.print_exc()
                        break
                    print(f"web: {name} ok ({time.monotonic() - t0:.1f} s)", flush=True)
                if not failed and run.errors():
                    failed = "console"
                    print("web: the page logged errors:", *run.errors(), sep="\n  ")
                if failed:
                    print("web: page console:", *run.console[-40:], sep="\n  ")
                context.close()
        finally:
            server.stop()
        if failed:
            print("web: server log:", *server.log[-60:], sep="\n  ")
            print(f"web: FAILED ({failed}); screenshots in {out}")
            return 1
    print(f"web: {len(SCENARIOS)} scenarios passed in {time.monotonic() - started:.1f} s; "
          f"screenshots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
