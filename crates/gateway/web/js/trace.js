// The trace view: a waterfall of a run's or a root turn's model calls, tool
// calls and sub-agent runs (GET api/agent-runs/{id}/trace,
// api/dialogs/{id}/turns/{turn}/trace).
// One row per span, its bar placed on the time axis from the root's
// creation to the last end; every string from the server is textContent.
import { h, replace } from './dom.js';
import { count, duration, short, statusLabel } from './format.js';

const ms = (iso) => (iso ? Date.parse(iso) : null);

/** The spans depth-first, each with its depth. */
function flatten(span, depth = 0, out = []) {
  out.push({ span, depth });
  for (const child of span.children) flatten(child, depth + 1, out);
  return out;
}

/** Where the axis starts and how long it is (at least 1 ms). */
function axis(rows) {
  const origin = ms(rows[0].span.created_at);
  let end = origin;
  for (const { span } of rows) {
    for (const t of [span.created_at, span.started_at, span.finished_at]) {
      if (t) end = Math.max(end, ms(t));
    }
  }
  return { origin, length: Math.max(1, end - origin) };
}

function bar(span, { origin, length }) {
  const created = ms(span.created_at);
  const start = ms(span.started_at);
  const end = ms(span.finished_at);
  const pct = (t) => `${(((t - origin) / length) * 100).toFixed(3)}%`;
  const track = h('div', { class: 'trace-track' });
  if (span.kind === 'turn') return track;
  if (span.kind === 'model' || span.kind === 'tool') {
    const call = h('div', {
      class: `trace-bar trace-call call-${span.kind} outcome-${span.outcome === 'error' ? 'error' : 'ok'}`,
      data: { role: 'bar' },
      title: duration(span.duration_ms ?? 0),
    });
    call.style.setProperty('--from', pct(start));
    call.style.setProperty('--to', pct(end));
    track.append(call);
    return track;
  }
  // Waiting to start (queued for a run permit), then running.
  const queued = h('div', { class: 'trace-queued' });
  queued.style.setProperty('--from', pct(created));
  queued.style.setProperty('--to', pct(start ?? end ?? created));
  const running = h('div', {
    class: `trace-bar status-${span.status}`,
    data: { role: 'bar' },
    title: span.duration_ms != null ? duration(span.duration_ms) : 'running',
  });
  running.style.setProperty('--from', pct(start ?? created));
  running.style.setProperty('--to', pct(end ?? origin + length));
  track.append(queued, running);
  return track;
}

function label(span) {
  const facts = [];
  if (span.kind === 'run') {
    facts.push(span.mode === 'background' ? 'bg' : 'fg', statusLabel(span.status));
    if (span.duration_ms != null) facts.push(duration(span.duration_ms));
    if (span.usage) facts.push(`${count(span.usage.prompt_tokens)} in · ${count(span.usage.completion_tokens)} out`);
    facts.push(`${span.model_calls} model · ${span.tool_calls} tool`);
  } else if (span.kind === 'model' || span.kind === 'tool') {
    if (span.outcome) facts.push(span.outcome);
    if (span.duration_ms != null) facts.push(duration(span.duration_ms));
    if (span.usage) facts.push(`${count(span.usage.prompt_tokens)} in · ${count(span.usage.completion_tokens)} out`);
  } else if (span.model_calls != null) {
    if (span.duration_ms != null) facts.push(duration(span.duration_ms));
    facts.push(`${span.model_calls} model · ${span.tool_calls} tool`);
  }
  return h('div', { class: 'trace-label' },
    h('span', { class: 'trace-name', text: span.kind === 'turn' ? `turn ${short(span.id)}` : span.name }),
    span.call_id && h('span', { class: 'trace-call-id', text: span.call_id }),
    h('span', { class: 'trace-facts', text: facts.join(' · ') }),
    span.task && h('span', { class: 'trace-task', text: span.task }),
    span.error && h('span', { class: 'trace-error', text: span.error }));
}

export class TraceView {
  /** `load(path)` resolves to a trace; `dialog` is the <dialog> it opens in. */
  constructor({ dialog, title, body, turnButton, load }) {
    Object.assign(this, { dialog, title, body, turnButton, load });
    this.turnButton.addEventListener('click', () => this.openTurn());
    this.current = null;
  }

  /** Opens the trace of `run` (from the run panel). */
  async openRun(dialogId, run) {
    await this.show(dialogId, `agent-runs/${run.id}/trace`, `Trace of ${run.agent} · ${short(run.id)}`);
  }

  /** Opens the trace of root turn `turn` of the dialog (an answer's button). */
  async openTurnId(dialogId, turn) {
    await this.show(dialogId, `dialogs/${dialogId}/turns/${turn}/trace`, `Trace of turn ${short(turn)}`);
  }

  /** Opens the trace of the turn the shown run belongs to. */
  async openTurn() {
    const turn = this.current?.trace.root.turn_id;
    if (!turn) return;
    await this.show(this.current.dialogId, `dialogs/${this.current.dialogId}/turns/${turn}/trace`, `Trace of turn ${short(turn)}`);
  }

  async show(dialogId, path, heading) {
    const trace = await this.load(path);
    if (!trace) return;
    this.current = { dialogId, trace };
    this.title.textContent = heading;
    this.turnButton.hidden = trace.root.kind === 'turn' || !trace.root.turn_id;
    const rows = flatten(trace.root);
    const ax = axis(rows);
    replace(this.body,
      h('p', { class: 'muted small', text: `${trace.runs} run(s) · ${trace.calls} call(s) · ${count(trace.usage.prompt_tokens)} tokens in · ${count(trace.usage.completion_tokens)} out · ${duration(ax.length)} shown` }),
      h('ol', { class: 'waterfall', 'aria-label': 'Spans, in start order' },
        rows.map(({ span, depth }) => {
          const row = h('li', { class: `trace-row kind-${span.kind}`, data: { spanId: span.id, kind: span.kind, status: span.status ?? '' } },
            label(span), bar(span, ax));
          row.style.setProperty('--depth', String(depth));
          return row;
        })),
      h('p', { class: 'muted small', text: 'Bars are runs (light: waiting for a permit) and their model and tool calls. A run whose loop failed shows no calls.' }));
    if (!this.dialog.open) this.dialog.showModal();
  }
}
