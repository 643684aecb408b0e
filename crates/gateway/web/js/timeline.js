// The checkpoint timeline: every checkpoint of the dialog, newest first, as
// a tree drawn like a commit graph. The branch the dialog's history runs
// through is drawn in colour; abandoned branches (left by a rollback) stay
// listed, greyed. Each checkpoint offers Rollback and Fork.
import { h, svg, replace } from './dom.js';
import { clock, short } from './format.js';

const LANE = 14;
const ROW = 44;

/**
 * Lane layout: walks checkpoints newest first; each lane waits for the
 * parent of the checkpoint above it. Returns, per row, the node's lane and
 * the lanes entering from above and leaving below.
 */
export function layout(items) {
  // A fork's first checkpoint has its parent in the dialog it came from:
  // no lane waits for a parent that is not listed.
  const listed = new Set(items.map((c) => c.id));
  let lanes = [];
  return items.map((c) => {
    const before = lanes.slice();
    let lane = lanes.findIndex((l) => l && l.expect === c.id);
    if (lane === -1) {
      lane = lanes.findIndex((l) => !l);
      if (lane === -1) lane = lanes.length;
    }
    lanes = lanes.map((l) => (l && l.expect === c.id ? null : l));
    lanes[lane] = listed.has(c.parent_id) ? { expect: c.parent_id, current: c.on_current_branch } : null;
    while (lanes.length && !lanes[lanes.length - 1]) lanes.pop();
    return { c, lane, before, after: lanes.slice() };
  });
}

function graph(row, width) {
  const x = (i) => LANE / 2 + i * LANE + 1;
  const mid = ROW / 2;
  const node = x(row.lane);
  const g = svg('svg', { class: 'graph', width, height: ROW, viewBox: `0 0 ${width} ${ROW}`, 'aria-hidden': 'true' });
  row.before.forEach((l, i) => {
    if (!l) return;
    const to = l.expect === row.c.id ? node : x(i);
    g.append(svg('path', { d: `M${x(i)} 0 C${x(i)} ${mid / 2} ${to} ${mid / 2} ${to} ${mid}`, class: l.current ? 'edge current' : 'edge' }));
  });
  row.after.forEach((l, i) => {
    if (!l) return;
    const from = i === row.lane ? node : x(i);
    g.append(svg('path', { d: `M${from} ${mid} L${x(i)} ${ROW}`, class: l.current ? 'edge current' : 'edge' }));
  });
  g.append(svg('circle', { cx: node, cy: mid, r: 5, class: row.c.on_current_branch ? 'node current' : 'node' }));
  return g;
}

const SOURCE = { turn: 'turn', manual: 'saved', rollback: 'rollback', fork: 'fork' };

/** Renders `items` (newest first) into `list`. */
export function renderTimeline(list, empty, items, { onRollback, onFork, head }) {
  const rows = layout(items);
  const lanes = Math.max(1, ...rows.map((r) => Math.max(r.lane + 1, r.before.length, r.after.length)));
  const width = lanes * LANE + 2;
  replace(list, ...rows.map((row) => {
    const c = row.c;
    const isHead = c.id === head;
    const label = {
      rollback: `Back to turn ${c.turn_index}`,
      fork: `Forked at turn ${c.turn_index}`,
    }[c.source] ?? `Turn ${c.turn_index}`;
    return h('li', {
      class: `checkpoint${c.on_current_branch ? ' current' : ' abandoned'}${isHead ? ' head' : ''}`,
      data: { checkpointId: c.id, current: String(c.on_current_branch) },
    },
    graph(row, width),
    h('div', { class: 'cp-text' },
      h('span', { class: 'cp-title' }, label, isHead && h('span', { class: 'tag', text: 'now' })),
      h('span', { class: 'cp-meta', text: `${SOURCE[c.source] ?? c.source} · ${clock(c.created_at)} · ${short(c.id)}` })),
    h('div', { class: 'cp-actions' },
      h('button', {
        type: 'button', class: 'mini', text: 'Rollback', disabled: isHead,
        'aria-label': `Roll back to ${label} (${short(c.id)})`,
        on: { click: () => onRollback(c) },
      }),
      h('button', {
        type: 'button', class: 'mini', text: 'Fork',
        'aria-label': `Fork a new dialog from ${label} (${short(c.id)})`,
        on: { click: () => onFork(c) },
      })));
  }));
  empty.hidden = items.length > 0;
}
