// The dialog's sub-agent work: the run tree (agent, mode, status, duration,
// what it spent: tokens, and cost where recorded; batches grouped; a trace
// of each run; cancel for runs that have not ended), signal cards, and the
// inbox (pending / delivered / dead-lettered events).
import { h, replace } from './dom.js';
import { count, duration, runDuration, short, statusLabel, clock, usd, TERMINAL } from './format.js';

/** What a run spent: "1.2k tok", "1.2k tok · $0.0042" once its cost is recorded. */
function spent(run) {
  const parts = [];
  if (run.usage) parts.push(`${count(run.usage.prompt_tokens + run.usage.completion_tokens)} tok`);
  if (run.cost_usd !== null && run.cost_usd !== undefined) parts.push(usd(run.cost_usd));
  return parts.join(' · ');
}

function runNode(run, children, { onCancel, onResult, onTrace, open }) {
  const ended = TERMINAL.has(run.status);
  const dur = h('span', { class: 'run-duration', data: { role: 'duration' }, text: duration(runDuration(run)) });
  const line = h('div', { class: 'run-line' },
    h('span', { class: 'status-dot', 'aria-hidden': 'true' }),
    h('span', { class: 'run-agent', text: run.agent }),
    h('span', { class: `badge mode-${run.mode}`, text: run.mode === 'background' ? 'bg' : 'fg', title: run.mode }),
    h('span', { class: 'run-status', text: statusLabel(run.status) }),
    dur,
    h('span', { class: 'run-tokens', text: spent(run) }));
  line.append(h('button', {
    type: 'button', class: 'mini', text: 'Trace', data: { action: 'trace' },
    'aria-label': `Trace of the ${run.agent} run ${short(run.id)}`,
    on: { click: () => onTrace(run) },
  }));
  if (!ended) {
    line.append(h('button', {
      type: 'button', class: 'mini danger', text: 'Cancel',
      'aria-label': `Cancel the ${run.agent} run ${short(run.id)}`,
      on: { click: () => onCancel(run) },
    }));
  }
  const detail = h('details', { class: 'run-detail', open: open.has(run.id) },
    h('summary', { text: run.task }),
    h('dl', { class: 'kv' },
      h('dt', { text: 'run' }), h('dd', { text: short(run.id) }),
      h('dt', { text: 'model' }), h('dd', { text: run.model }),
      h('dt', { text: 'calls' }), h('dd', { text: `${run.iterations} model · ${run.tool_calls} tool` }),
      run.usage && [h('dt', { text: 'tokens' }), h('dd', { text: `${count(run.usage.prompt_tokens)} in · ${count(run.usage.completion_tokens)} out` })],
      run.cost_usd != null && [h('dt', { text: 'cost' }), h('dd', { text: usd(run.cost_usd) })],
      h('dt', { text: 'started' }), h('dd', { text: clock(run.created_at) })),
    run.error && h('p', { class: 'run-error', text: run.error }),
    run.result_preview && h('div', { class: 'run-result' },
      h('pre', { text: run.result_preview }),
      run.result_bytes > run.result_preview.length && h('button', {
        type: 'button', class: 'mini', text: 'Load the whole result',
        on: { click: (e) => onResult(run, e.target) },
      })));
  detail.addEventListener('toggle', () => (detail.open ? open.add(run.id) : open.delete(run.id)));
  return h('li', { class: 'run', data: { runId: run.id, status: run.status, agent: run.agent, mode: run.mode } },
    line, detail, children.length > 0 && h('ul', { class: 'run-children' }, children));
}

/** Children of `parent` (null: the root agent's), batches grouped, oldest first. */
function level(runs, parent, ctx) {
  const mine = runs.filter((r) => (r.parent_run_id ?? null) === parent)
    .sort((a, b) => a.created_at.localeCompare(b.created_at) || a.id.localeCompare(b.id));
  const out = [];
  const groups = new Map();
  for (const run of mine) {
    const node = runNode(run, level(runs, run.id, ctx), ctx);
    if (!run.group_id) {
      out.push(node);
      continue;
    }
    let group = groups.get(run.group_id);
    if (!group) {
      group = { list: h('ul', { class: 'run-children' }), runs: [] };
      groups.set(run.group_id, group);
      out.push(group);
    }
    group.runs.push(run);
    group.list.append(node);
  }
  return out.map((item) => {
    if (item instanceof Node) return item;
    if (item.runs.length === 1) return item.list.firstChild;
    const done = item.runs.filter((r) => TERMINAL.has(r.status)).length;
    return h('li', { class: 'run-group' },
      h('div', { class: 'group-line', text: `batch of ${item.runs.length} · ${done}/${item.runs.length} ended` }),
      item.list);
  });
}

export class RunsView {
  constructor({ tree, count, empty, signals, signalsEmpty, inbox, onCancel, onResult, onTrace }) {
    Object.assign(this, { tree, count, empty, signals, signalsEmpty, inbox });
    this.ctx = { onCancel, onResult, onTrace, open: new Set() };
    this.runs = new Map();
    this.events = new Map();
    setInterval(() => this.tick(), 1000);
  }

  reset() {
    this.runs.clear();
    this.events.clear();
    this.counts = null;
    this.ctx.open.clear();
    this.render();
  }

  /** Keeps `run` unless a newer revision of it is known. */
  run(run) {
    const old = this.runs.get(run.id);
    if (old && old.revision > run.revision) return false;
    this.runs.set(run.id, run);
    return true;
  }

  event(event) {
    const old = this.events.get(event.id);
    if (old && old.revision > event.revision) return false;
    this.events.set(event.id, event);
    return true;
  }

  /** Keeps the server's inbox counts unless newer ones are known. */
  inboxCounts(counts) {
    if (this.counts && this.counts.revision > counts.revision) return false;
    this.counts = counts;
    return true;
  }

  /** Tokens of every known run. */
  usage() {
    let total = 0;
    for (const r of this.runs.values()) total += (r.usage?.prompt_tokens ?? 0) + (r.usage?.completion_tokens ?? 0);
    return { runs: this.runs.size, tokens: total };
  }

  render() {
    const runs = [...this.runs.values()];
    replace(this.tree, ...level(runs, null, this.ctx));
    this.empty.hidden = runs.length > 0;
    const active = runs.filter((r) => !TERMINAL.has(r.status)).length;
    this.count.textContent = runs.length ? `${runs.length}${active ? ` · ${active} active` : ''}` : '';
    this.renderSignals();
    this.renderInbox();
  }

  renderSignals() {
    const signals = [...this.events.values()].filter((e) => e.type === 'signal')
      .sort((a, b) => b.created_at.localeCompare(a.created_at));
    replace(this.signals, ...signals.map((e) => {
      const run = e.run_id && this.runs.get(e.run_id);
      const p = e.payload ?? {};
      const summary = typeof p === 'string' ? p : (p.summary ?? p.message ?? JSON.stringify(p));
      const severity = e.severity ?? 'info';
      return h('li', { class: `signal severity-${severity}`, data: { eventId: e.id, severity, status: e.status } },
        h('div', { class: 'signal-head' },
          h('span', { class: 'severity', text: severity }),
          h('span', { class: 'signal-run', text: run ? `${run.agent} · ${short(run.id)}` : short(e.run_id ?? e.group_id) }),
          h('span', { class: 'signal-time', text: clock(e.created_at) })),
        h('p', { class: 'signal-summary', text: summary }),
        h('div', { class: 'signal-status', text: statusLabel(e.status) }));
    }));
    this.signalsEmpty.hidden = signals.length > 0;
  }

  /** The server's counts of the dialog's events by delivery state, and the latest events. */
  renderInbox() {
    const counts = this.counts;
    const events = [...this.events.values()].sort((a, b) => b.created_at.localeCompare(a.created_at));
    const stat = (key, label) => h('div', { class: `inbox-stat ${key}${counts?.[key] ? ' nonzero' : ''}`, data: { key } },
      h('span', { class: 'inbox-n', text: counts ? String(counts[key]) : '–' }), h('span', { text: label }));
    const rows = events.slice(0, 20).map((e) => {
      const run = e.run_id && this.runs.get(e.run_id);
      const what = e.type === 'signal' ? 'signal' : e.type === 'completion' ? 'completion' : 'batch completion';
      return h('li', { data: { eventId: e.id, status: e.status } },
        h('span', { class: `inbox-status status-${e.status}`, text: statusLabel(e.status) }),
        h('span', { text: `${what}${run ? ` of ${run.agent}` : ''}` }));
    });
    replace(this.inbox,
      h('div', { class: 'inbox-stats' }, stat('pending', 'pending'), stat('delivered', 'delivered'), stat('dead_lettered', 'dead-lettered')),
      counts?.superseded > 0 && h('p', { class: 'muted small', text: `${counts.superseded} withdrawn with a cancelled run` }),
      rows.length > 0 && h('ul', { class: 'inbox-list' }, rows));
  }

  /** Durations of running runs move on. */
  tick() {
    for (const li of this.tree.querySelectorAll('li.run')) {
      const run = this.runs.get(li.dataset.runId);
      if (run && !TERMINAL.has(run.status)) {
        const d = li.querySelector(':scope > .run-line [data-role=duration]');
        if (d) d.textContent = duration(runDuration(run));
      }
    }
  }
}
