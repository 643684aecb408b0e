// How numbers, times and ids are shown.

/** 1234 → "1.2k". */
export function count(n) {
  if (n === null || n === undefined) return '–';
  if (n < 1000) return String(n);
  if (n < 1e6) return `${(n / 1e3).toFixed(n < 1e4 ? 1 : 0)}k`;
  return `${(n / 1e6).toFixed(1)}M`;
}

/** USD → "$0.0042", "$1.25". */
export function usd(n) {
  if (n === null || n === undefined) return '';
  return `$${n.toFixed(n < 0.995 ? 4 : 2)}`;
}

/** Milliseconds → "850 ms", "4.2 s", "3 min 5 s". */
export function duration(ms) {
  if (ms === null || ms === undefined || ms < 0) return '';
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ${Math.round(s % 60)} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

/** The duration of a run so far, or in total once it ended. */
export function runDuration(run, now = Date.now()) {
  if (!run.started_at) return null;
  const start = Date.parse(run.started_at);
  const end = run.finished_at ? Date.parse(run.finished_at) : now;
  return end - start;
}

/** An RFC 3339 time → "14:03" today, "30 Nov 14:03" otherwise. */
export function clock(iso) {
  const d = new Date(iso);
  const today = new Date();
  const time = d.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit' });
  if (d.toDateString() === today.toDateString()) return time;
  return `${d.toLocaleDateString([], { day: 'numeric', month: 'short' })} ${time}`;
}

/** The last 8 hex digits of a UUID (its random part). */
export function short(id) {
  return id ? id.replace(/-/g, '').slice(-8) : '';
}

/** Statuses after which a run changes no more. */
export const TERMINAL = new Set(['completed', 'failed', 'timed_out', 'cancelled', 'interrupted', 'budget_exhausted']);

/** "waiting_children" → "waiting for children". */
export function statusLabel(status) {
  return {
    waiting_children: 'waiting for children',
    waiting_approval: 'waiting for approval',
    timed_out: 'timed out',
    dead_letter: 'dead-lettered',
    consumed: 'delivered',
  }[status] ?? status.replace(/_/g, ' ');
}
