// The conversation: the dialog's visible history and the turns streaming
// into it. A turn is one <article>: its text (Markdown, sanitized) and its
// tool calls as collapsible lines. Continuation turns (turn_origin
// agent_continuation) carry a light label, not a user bubble: the one that
// goes on after approvals were decided (it follows the calls' results)
// says so, the others answer background results.
import { h, replace } from './dom.js';
import { renderMarkdown } from './markdown.js';
import { clock } from './format.js';
import { imageDataUrl } from './api.js';

const CONTINUATION = 'agent_continuation';
const BACKGROUND_LABEL = 'Background results arrived';
const APPROVAL_LABEL = 'Approval decided';

function toolLine(name, args) {
  const argText = typeof args === 'string' ? args : JSON.stringify(args ?? {});
  const state = h('span', { class: 'tool-state', text: 'running' });
  const output = h('pre', { class: 'tool-output', text: '' });
  const el = h('details', { class: 'tool', data: { state: 'running' } },
    h('summary', {},
      h('span', { class: 'tool-icon', 'aria-hidden': 'true' }),
      h('span', { class: 'tool-name', text: name }),
      h('code', { class: 'tool-args', text: argText }),
      state),
    h('div', { class: 'tool-body' },
      h('div', { class: 'tool-label', text: 'Arguments' }),
      h('pre', { class: 'tool-input', text: JSON.stringify(args ?? {}, null, 2) }),
      h('div', { class: 'tool-label', text: 'Output' }),
      output));
  return {
    el,
    finished: false,
    /** A saved call without a result yet: it waits (for an approval, mostly). */
    waiting() {
      el.dataset.state = 'waiting';
      state.textContent = 'no result yet';
    },
    finish(text, isError) {
      this.finished = true;
      el.dataset.state = isError ? 'error' : 'ok';
      // A call nobody approved did not run: it was denied, not broken.
      const denied = isError && (text ?? '').startsWith('denied:');
      state.textContent = denied ? 'denied' : isError ? 'error' : 'done';
      output.textContent = text ?? '';
    },
  };
}

/** One assistant turn being shown: text blocks and tool lines in order. */
class TurnView {
  /** `resumed`: a continuation that goes on after approvals were decided. */
  constructor(origin, time, resumed = false) {
    this.el = h('article', { class: 'msg assistant', data: { origin } });
    if (origin === CONTINUATION) {
      const text = resumed ? APPROVAL_LABEL : BACKGROUND_LABEL;
      this.el.append(h('div', { class: 'turn-label', text }));
    }
    this.body = h('div', { class: 'msg-body' });
    this.el.append(this.body);
    if (time) this.el.append(h('div', { class: 'msg-meta', text: clock(time) }));
    this.text = null;
    this.tools = new Map();
    this.pending = false;
  }

  /** Appends streamed text to the last text block. */
  appendText(text) {
    if (!this.text) {
      const el = h('div', { class: 'md' });
      this.body.append(el);
      this.text = { el, source: '' };
    }
    this.text.source += text;
    if (!this.pending) {
      this.pending = true;
      requestAnimationFrame(() => {
        this.pending = false;
        renderMarkdown(this.text.el, this.text.source);
      });
    }
  }

  /** A whole text block (history). */
  setText(text) {
    if (!text) return;
    const el = h('div', { class: 'md' });
    renderMarkdown(el, text);
    this.body.append(el);
    this.text = null;
  }

  tool(id, name, args) {
    const line = toolLine(name, args);
    this.tools.set(id, line);
    this.body.append(line.el);
    this.text = null;
    return line;
  }

  finishTool(id, name, output, isError) {
    (this.tools.get(id) ?? this.tool(id, name, {})).finish(output, isError);
  }

  note(text, kind) {
    this.body.append(h('p', { class: `turn-note ${kind}`, text }));
  }

  streaming(on) {
    this.el.classList.toggle('streaming', on);
    this.el.setAttribute('aria-busy', on ? 'true' : 'false');
  }
}

/**
 * A message's images: a stored one (`/api/images/…`) loaded with the token,
 * any other (an https URL the client sent) as a link, never fetched.
 */
function messageImages(images) {
  return (images ?? []).map((image) => {
    if (!image.url.startsWith('/api/images/')) {
      return h('a', { class: 'msg-image-link', href: image.url, rel: 'noopener noreferrer', target: '_blank', text: image.url });
    }
    const img = h('img', { class: 'msg-image', alt: 'image' });
    imageDataUrl(image.url).then((src) => { img.src = src; }, () => { img.alt = 'image (cannot be loaded)'; });
    return img;
  });
}

function userBubble(text, { time, unanswered, steer, images } = {}) {
  const el = h('article', { class: 'msg user' },
    h('div', { class: 'msg-body' }, h('p', { class: 'user-text', text }), messageImages(images)));
  const meta = h('div', { class: 'msg-meta' });
  if (steer) meta.append(h('span', { class: 'tag', text: 'steer' }));
  if (time) meta.append(h('span', { text: clock(time) }));
  el.append(meta);
  if (unanswered) markUnanswered(el);
  return el;
}

/** Marks a user message as not answered (its turn failed or was stopped). */
export function markUnanswered(el, why) {
  if (el.classList.contains('unanswered')) return;
  el.classList.add('unanswered');
  el.dataset.unanswered = 'true';
  el.querySelector('.msg-meta')?.prepend(
    h('span', { class: 'tag warn', title: why ?? 'No answer was saved for this message', text: 'unanswered' }));
}

export class Chat {
  constructor(container, empty, jump) {
    this.container = container;
    this.empty = empty;
    this.jump = jump;
    jump.addEventListener('click', () => this.scroll());
    container.addEventListener('scroll', () => {
      if (this.atBottom()) jump.hidden = true;
    }, { passive: true });
    this.live = new Map();
    this.byTurn = new Map();
    this.failedTurns = new Map();
    // Root turns committed while the page is open, by the seq of their
    // answer's first message (per dialog: `dialog` is the one they are of).
    this.turnBySeq = new Map();
    this.committed = [];
    this.dialog = null;
    // An approval was decided: the next continuation turn resumes its turn.
    this.resumeNext = false;
  }

  /** A decided approval (`approval_decided`) of the shown dialog. */
  approvalDecided(approval) {
    // A background run's decision resumes the run, not a turn.
    if (approval.status !== 'superseded' && !approval.run_id) this.resumeNext = true;
  }

  get running() {
    return this.live.size > 0;
  }

  /** Shows the dialog's history (oldest first), replacing what is shown. */
  showHistory(messages, hasEarlier, onEarlier, dialog = null) {
    if (dialog !== this.dialog) {
      this.dialog = dialog;
      this.turnBySeq.clear();
      this.committed = [];
    }
    const stick = this.atBottom();
    const nodes = [];
    if (hasEarlier) {
      nodes.push(h('button', { type: 'button', class: 'quiet earlier', text: 'Show earlier messages', on: { click: onEarlier } }));
    }
    let turn = null;
    let previous = null;
    const turns = [];
    for (const m of messages) {
      if (m.role === 'user') {
        turn = null;
        nodes.push(userBubble(m.text, { time: m.created_at, unanswered: m.unanswered === true, images: m.images }));
      } else if (m.role === 'assistant') {
        const origin = m.turn_origin ?? 'user';
        if (!turn || (origin === CONTINUATION && turn.origin !== CONTINUATION)) {
          // Only a paused turn's decided calls end in results the model has
          // not answered yet; a background continuation follows an answer.
          turn = new TurnView(origin, m.created_at, previous === 'tool');
          turn.origin = origin;
          turn.firstSeq = m.seq;
          nodes.push(turn.el);
          turns.push(turn);
        }
        turn.setText(m.text);
        for (const c of m.tool_calls ?? []) turn.tool(c.id, c.name, c.arguments);
      } else if (m.role === 'tool' && turn) {
        const line = turn.tools.get(m.tool_call_id);
        if (line) line.finish(m.text, m.is_error === true);
      }
      previous = m.role;
    }
    // Answers committed while the page was open keep their turn's Trace
    // button: the newest turns are the ones committed since the last load.
    const pending = this.committed.splice(0);
    for (let i = 0; i < pending.length && i < turns.length; i += 1) {
      const view = turns[turns.length - pending.length + i];
      if (view) this.turnBySeq.set(view.firstSeq, pending[i]);
    }
    for (const view of turns) {
      const id = this.turnBySeq.get(view.firstSeq);
      if (id) this.traceButton(view, id);
    }
    // Saved calls without a result wait (for an approval); they do not run.
    for (const view of turns) {
      for (const line of view.tools.values()) if (!line.finished) line.waiting();
    }
    // Turns still streaming stay below the history.
    for (const view of this.live.values()) nodes.push(view.el);
    replace(this.container, ...nodes);
    this.empty.hidden = nodes.length > 0;
    if (nodes.length === 0) this.container.append(this.empty);
    if (stick) this.scroll();
  }

  /** Adds a Trace button for root turn `turn` to an answer's view. */
  traceButton(view, turn) {
    if (!this.onTrace || view.el.querySelector('.trace-turn')) return;
    view.el.append(h('button', {
      type: 'button', class: 'mini trace-turn', text: 'Trace',
      title: `Trace of turn ${turn}`, data: { action: 'trace-turn', turnId: turn },
      on: { click: () => this.onTrace(turn) },
    }));
  }

  /** Follows what arrived when the reader was at the end; else offers to jump there. */
  grew(stick) {
    if (stick) this.scroll();
    else this.jump.hidden = false;
  }

  /** Clears everything (another dialog is shown). */
  reset() {
    this.resumeNext = false;
    this.live.clear();
    this.byTurn.clear();
    this.failedTurns.clear();
    replace(this.container, this.empty);
    this.empty.hidden = false;
    this.jump.hidden = true;
  }

  /** Shows a message the user just sent; returns its element. */
  addUser(text, steer) {
    const el = userBubble(text, { time: new Date().toISOString(), steer });
    el.classList.add('sending');
    this.add(el);
    // What the user sends is where they look next.
    this.scroll();
    return el;
  }

  /** A steer that found no running turn, sent as a message instead. */
  unsteer(el) {
    el.querySelector('.tag')?.remove();
  }

  /** Links a sent message to its turn (from `turn_accepted`). */
  accepted(el, turnId) {
    el.classList.remove('sending');
    el.dataset.turn = turnId;
    this.byTurn.set(turnId, el);
    const failed = this.failedTurns.get(turnId);
    if (failed) markUnanswered(el, failed);
  }

  add(el) {
    const stick = this.atBottom();
    this.empty.hidden = true;
    this.empty.remove();
    this.container.append(el);
    this.grew(stick);
  }

  /** Applies a turn frame of the shown dialog. */
  frame(f) {
    let view = this.live.get(f.turn_id);
    const stick = this.atBottom();
    switch (f.type) {
      case 'turn_started':
        if (view) return;
        view = new TurnView(f.turn_origin, new Date().toISOString(),
          f.turn_origin === CONTINUATION && this.resumeNext);
        this.resumeNext = false;
        view.streaming(true);
        this.live.set(f.turn_id, view);
        this.add(view.el);
        break;
      case 'text_delta':
        view?.appendText(f.text);
        break;
      case 'tool_started':
        view?.tool(f.call_id, f.name, f.arguments);
        break;
      case 'tool_finished':
        view?.finishTool(f.call_id, f.name, f.output, f.is_error);
        break;
      case 'notice':
        view?.note(f.text, 'notice');
        break;
      case 'turn_committed':
        view?.streaming(false);
        if (view) {
          // The committed turn's calls are stored: its trace can be read.
          this.traceButton(view, f.turn_id);
          // The history shown next holds its answer as its newest turn.
          this.committed.push(f.turn_id);
        }
        this.live.delete(f.turn_id);
        break;
      case 'turn_failed': {
        // A kept message stays in the history, unanswered; the next turn sees it.
        const stopped = f.input_kept
          ? 'Stopped — your message is kept, unanswered.'
          : 'Stopped — nothing of this turn was saved.';
        const why = f.cancelled ? stopped : f.message;
        if (view) {
          view.streaming(false);
          view.note(why, f.cancelled ? 'stopped' : 'failed');
          view.el.classList.add('failed');
        }
        this.live.delete(f.turn_id);
        const bubble = this.byTurn.get(f.turn_id);
        if (bubble) markUnanswered(bubble, why);
        else this.failedTurns.set(f.turn_id, why);
        break;
      }
      default:
        return;
    }
    this.grew(stick);
  }

  atBottom() {
    const c = this.container;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
  }

  /** Shows the end of the conversation at the next frame (after the text
   *  that just arrived is rendered), unless the reader scrolled away since. */
  scroll() {
    this.jump.hidden = true;
    const from = this.container.scrollTop;
    requestAnimationFrame(() => {
      const c = this.container;
      if (c.scrollTop === from) c.scrollTop = c.scrollHeight;
      else this.jump.hidden = this.atBottom();
    });
  }
}
