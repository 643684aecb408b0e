// keel's web page: wires the API client to the views. State lives here;
// the server is the source of truth, and whatever the page shows can be
// re-read from it (after a reconnect, a resync, or a reload).
import { $, h } from './dom.js';
import { call, token, Socket } from './api.js';
import { Chat, markUnanswered } from './chat.js';
import { RunsView } from './runs.js';
import { renderTimeline } from './timeline.js';
import { renderDialogs } from './dialogs.js';
import { ApprovalsView } from './approvals.js';
import { TraceView } from './trace.js';
import { count } from './format.js';

const PAGE = 100;
const LAST_DIALOG = 'keel.dialog';

const state = {
  dialogs: [],
  agents: [],
  current: null,
  revision: 0,
  // The event id of the last turn frame of the shown dialog: a reconnect
  // resumes after it; without one the page joins the running turn.
  lastEvent: null,
  history: [],
  earlier: null,
  checkpoints: [],
  usage: null,
  steer: false,
  everOpen: false,
  loads: 0,
};

const input = $('input');
const chat = new Chat($('messages'), $('empty'), $('jump'));
const runs = new RunsView({
  tree: $('run-tree'),
  count: $('runs-count'),
  empty: $('runs-empty'),
  signals: $('signals'),
  signalsEmpty: $('signals-empty'),
  inbox: $('inbox'),
  onCancel: cancelRun,
  onResult: loadResult,
  onTrace: (run) => state.current && traces.openRun(state.current.id, run),
});
const traces = new TraceView({
  dialog: $('trace-dialog'),
  title: $('trace-title'),
  body: $('trace-body'),
  turnButton: $('trace-turn'),
  load: (path) => attempt('Reading the trace', () => api('GET', path)),
});
chat.onTrace = (turn) => state.current && traces.openTurnId(state.current.id, turn);
const approvals = new ApprovalsView($('approvals'), decideApproval);
const socket = new Socket({ onFrame, onState });

// ── errors, token ─────────────────────────────────────────────────────────

function notify(text, kind = 'error') {
  let box = $('toasts');
  if (!box) {
    box = h('div', { id: 'toasts', class: 'toasts', role: 'alert' });
    document.body.append(box);
  }
  const toast = h('div', { class: `toast ${kind}`, text });
  box.append(toast);
  setTimeout(() => toast.remove(), kind === 'error' ? 8000 : 4000);
}

let asking = null;

/** Shows the token prompt; resolves once a token was entered. */
function askToken(rejected) {
  if (asking) return asking;
  const dialog = $('token-dialog');
  const error = $('token-error');
  error.hidden = !rejected;
  error.textContent = rejected ? 'That token was not accepted. Try again.' : '';
  asking = new Promise((resolve) => {
    $('token-form').onsubmit = () => {
      token.set($('token-input').value.trim());
      $('token-input').value = '';
      asking = null;
      resolve();
    };
  });
  dialog.showModal();
  return asking;
}

/** A REST call; a 401 asks for the token and tries again. */
async function api(method, path, body) {
  for (;;) {
    try {
      return await call(method, path, body);
    } catch (e) {
      if (e.status !== 401) throw e;
      await askToken(Boolean(token.get()));
      socket.reconnect();
    }
  }
}

async function attempt(what, fn) {
  try {
    return await fn();
  } catch (e) {
    notify(`${what}: ${e.message}`);
    return undefined;
  }
}

// ── dialogs ───────────────────────────────────────────────────────────────

async function loadDialogs() {
  const page = await api('GET', `dialogs?limit=${PAGE}`);
  state.dialogs = page.items;
  renderDialogs($('dialog-list'), state.dialogs, state.current?.id, select);
}

function showDialog(dialog) {
  state.current = dialog;
  const i = state.dialogs.findIndex((d) => d.id === dialog.id);
  if (i >= 0) state.dialogs[i] = dialog;
  else state.dialogs.unshift(dialog);
  $('dialog-title').textContent = dialog.title;
  document.title = `${dialog.title} · keel`;
  enableActions(true);
  renderAgents();
  renderDialogs($('dialog-list'), state.dialogs, dialog.id, select);
}

// The agents a dialog can switch to: the catalog's, as /v1/models lists
// them (`keel:NAME`), read once; the current dialog's agent is always an
// option, even when a reload removed it.
async function loadAgents() {
  const models = await api('GET', '../v1/models');
  state.agents = models.data.map((m) => m.id.replace(/^keel:/, ''));
  renderAgents();
}

function renderAgents() {
  const select = $('agent-select');
  const current = state.current?.agent ?? 'root';
  const names = state.agents.includes(current) ? state.agents : [current, ...state.agents];
  select.replaceChildren(...names.map((name) => h('option', { value: name, text: name })));
  select.value = current;
}

async function switchAgent() {
  const dialog = state.current;
  const agent = $('agent-select').value;
  if (!dialog || agent === (dialog.agent ?? 'root')) return;
  const changed = await attempt(`Switching to ${agent}`, () => api('PATCH', `dialogs/${dialog.id}`, { agent }));
  if (changed) showDialog(changed);
  else renderAgents();
}

function enableActions(on) {
  for (const b of document.querySelectorAll('[data-action]')) b.disabled = !on;
}

function clearDialog() {
  state.current = null;
  state.history = [];
  chat.reset();
  runs.reset();
  approvals.reset();
  state.checkpoints = [];
  state.usage = null;
  renderCheckpoints();
  renderCounters();
  $('dialog-title').textContent = 'No dialog';
  document.title = 'keel';
  enableActions(false);
  history.replaceState(null, '', location.pathname);
  renderDialogs($('dialog-list'), state.dialogs, null, select);
}

/** Shows dialog `id`: its history, runs, events and checkpoints. */
async function select(id) {
  setPanel('');
  if (state.current?.id === id) return true;
  const previous = state.current;
  const dialog = await attempt('Opening the dialog', () => api('GET', `dialogs/${id}`));
  if (!dialog) return false;
  if (previous && socket.open) socket.request({ type: 'unsubscribe', session_id: previous.id }).catch(() => {});
  clearDialog();
  state.revision = 0;
  state.lastEvent = null;
  showDialog(dialog);
  localStorage.setItem(LAST_DIALOG, id);
  history.replaceState(null, '', `#d=${id}`);
  await Promise.all([subscribe(), loadMessages(), loadCheckpoints(), loadUsage(),
    attempt('Reading the inbox', loadInbox), attempt('Reading the approvals', loadApprovals)]);
  updateComposer();
  return true;
}

async function createDialog() {
  const dialog = await api('POST', 'dialogs', {});
  await loadDialogs();
  await select(dialog.id);
  return dialog;
}

async function refreshDialog() {
  if (!state.current) return;
  const dialog = await api('GET', `dialogs/${state.current.id}`);
  if (state.current?.id === dialog.id) showDialog(dialog);
}

// ── the conversation ──────────────────────────────────────────────────────

async function loadMessages() {
  const dialog = state.current;
  if (!dialog) return;
  const load = ++state.loads;
  const page = await attempt('Reading the messages', () => api('GET', `dialogs/${dialog.id}/messages?order=desc&limit=${PAGE}`));
  if (!page || load !== state.loads || state.current?.id !== dialog.id) return;
  state.history = page.items.reverse();
  state.earlier = page.next_cursor;
  chat.showHistory(state.history, Boolean(state.earlier), loadEarlier, state.current?.id);
}

async function loadEarlier() {
  const dialog = state.current;
  const page = await attempt('Reading earlier messages', () =>
    api('GET', `dialogs/${dialog.id}/messages?order=desc&limit=${PAGE}&cursor=${encodeURIComponent(state.earlier)}`));
  if (!page || state.current?.id !== dialog.id) return;
  state.history = page.items.reverse().concat(state.history);
  state.earlier = page.next_cursor;
  chat.showHistory(state.history, Boolean(state.earlier), loadEarlier, state.current?.id);
}

/** Images pasted or dropped into the composer, sent with the next message. */
const attachments = [];

function renderAttachments() {
  const box = $('attachments');
  box.replaceChildren(...attachments.map((a, i) => h('span', { class: 'attachment' },
    h('img', { src: a.dataUrl, alt: 'attached image' }),
    h('button', {
      type: 'button', class: 'quiet', 'aria-label': 'Remove this image', text: '×',
      on: { click: () => { attachments.splice(i, 1); renderAttachments(); } },
    }))));
  box.hidden = attachments.length === 0;
}

/** Attaches the image files among `files` (the server checks type and size again). */
function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith('image/')) continue;
    const reader = new FileReader();
    reader.onload = () => {
      const dataUrl = reader.result;
      attachments.push({ dataUrl, mime_type: file.type, data: dataUrl.slice(dataUrl.indexOf(',') + 1) });
      renderAttachments();
    };
    reader.readAsDataURL(file);
  }
}

async function send() {
  const text = input.value;
  const parts = attachments.map((a) => ({ type: 'image', data: a.data, mime_type: a.mime_type }));
  if (!text.trim() && parts.length === 0) return;
  if (!socket.open) {
    notify('Not connected: the message was not sent. It is still in the box.');
    return;
  }
  if (!state.current && !(await attempt('Creating a dialog', createDialog))) return;
  const dialog = state.current;
  // A steer carries text only: a message with images is sent as a message.
  const steering = chat.running && state.steer && parts.length === 0;
  input.value = '';
  attachments.length = 0;
  renderAttachments();
  autosize();
  const bubble = chat.addUser(text, steering);
  try {
    const steered = steering && (await socket.request({ type: 'steer', session_id: dialog.id, text })).steered;
    if (steered) {
      bubble.classList.remove('sending');
    } else {
      // No turn was running (any more): the text starts one.
      if (steering) chat.unsteer(bubble);
      const frame = { type: 'send', session_id: dialog.id, text };
      if (parts.length) frame.parts = parts;
      const answer = await socket.request(frame);
      chat.accepted(bubble, answer.turn_id);
    }
  } catch (e) {
    bubble.classList.remove('sending');
    markUnanswered(bubble, e.message);
    notify(`The message was not accepted: ${e.message}`);
  }
  updateComposer();
}

async function stop() {
  if (!state.current) return;
  await attempt('Stopping', () => api('POST', `dialogs/${state.current.id}/stop`));
}

function updateComposer() {
  const running = chat.running;
  $('stop').hidden = !running;
  $('send').textContent = running ? (state.steer ? 'Steer' : 'Queue') : 'Send';
  $('composer-hint').textContent = running
    ? `A turn is running: Enter ${state.steer ? 'steers it' : 'queues your message'} · Esc stops it`
    : 'Enter sends · Shift+Enter new line · Esc stops';
}

function autosize() {
  input.style.height = 'auto';
  input.style.height = `${Math.min(input.scrollHeight, 240)}px`;
}

// ── approvals ─────────────────────────────────────────────────────────────

/** Re-reads the dialog's pending approvals and shows exactly those. */
async function loadApprovals() {
  const dialog = state.current;
  if (!dialog) return;
  const list = await api('GET', `dialogs/${dialog.id}/approvals?status=pending`);
  if (state.current?.id === dialog.id) approvals.showPending(list.items);
}

/** Sends a decision; the card leaves when `approval_decided` arrives (or now, from the answer). */
async function decideApproval(approval, decision, reason) {
  const body = reason === undefined ? { decision } : { decision, reason };
  const decided = await api('POST', `approvals/${approval.id}`, body);
  if (decided && decided.status !== 'pending') approvals.decided(decided);
}

// ── runs, events, checkpoints, usage ─────────────────────────────────────

let renderQueued = false;
function renderRuns() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    runs.render();
    renderCounters();
  });
}

/** Re-reads every run (all pages) and event of the dialog. */
async function loadRuns() {
  const dialog = state.current;
  let cursor = null;
  do {
    const q = `agent-runs?session_id=${dialog.id}&limit=200${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`;
    const page = await api('GET', q);
    if (state.current?.id !== dialog.id) return;
    if (cursor === null) state.revision = Math.max(state.revision, page.revision ?? 0);
    page.items.forEach((r) => runs.run(r));
    cursor = page.next_cursor;
  } while (cursor);
  renderRuns();
}

/** Re-reads every event (signal, completion) of the dialog, all pages. */
async function loadEvents() {
  const dialog = state.current;
  let cursor = null;
  do {
    const q = `dialogs/${dialog.id}/agent-events?limit=200${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`;
    const page = await api('GET', q);
    if (state.current?.id !== dialog.id) return;
    if (cursor === null) state.revision = Math.max(state.revision, page.revision);
    page.items.forEach((e) => runs.event(e));
    cursor = page.next_cursor;
  } while (cursor);
  renderRuns();
}

const inboxReads = { running: false, again: false };

/** Re-reads the dialog's inbox counts; calls while one runs make one more read after it. */
async function loadInbox() {
  if (inboxReads.running) {
    inboxReads.again = true;
    return;
  }
  inboxReads.running = true;
  try {
    do {
      inboxReads.again = false;
      const dialog = state.current;
      if (!dialog) return;
      const counts = await api('GET', `dialogs/${dialog.id}/inbox`);
      if (state.current?.id === dialog.id && runs.inboxCounts(counts)) renderRuns();
    } while (inboxReads.again);
  } finally {
    inboxReads.running = false;
  }
}

async function cancelRun(run) {
  const ended = await attempt(`Cancelling ${run.agent}`, () => api('POST', `agent-runs/${run.id}/cancel`));
  if (ended && runs.run(ended)) renderRuns();
}

async function loadResult(run, button) {
  const full = await attempt('Reading the result', () => api('GET', `agent-runs/${run.id}`));
  if (full?.result) {
    button.previousElementSibling.textContent = full.result;
    button.remove();
  }
}

/** Re-reads every checkpoint of the dialog, all pages, then draws the timeline once. */
async function loadCheckpoints() {
  const dialog = state.current;
  if (!dialog) return;
  const all = [];
  let cursor = null;
  do {
    const q = `dialogs/${dialog.id}/checkpoints?limit=200${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`;
    const page = await attempt('Reading the checkpoints', () => api('GET', q));
    if (!page || state.current?.id !== dialog.id) return;
    all.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor);
  state.checkpoints = all;
  renderCheckpoints();
}

function renderCheckpoints() {
  const head = state.checkpoints.find((c) => c.on_current_branch)?.id;
  renderTimeline($('timeline'), $('timeline-empty'), state.checkpoints, { head, onRollback: rollback, onFork: fork });
}

async function rollback(checkpoint) {
  const dialog = state.current;
  const done = await attempt('Rolling back', () => api('POST', `dialogs/${dialog.id}/checkpoints/${checkpoint.id}/rollback`));
  if (!done) return;
  await Promise.all([loadMessages(), loadCheckpoints(), loadUsage()]);
  notify(`Rolled back to turn ${checkpoint.turn_index}; the later turns stay listed as an abandoned branch.`, 'info');
}

async function fork(checkpoint) {
  const dialog = await attempt('Forking', () => api('POST', `dialogs/${state.current.id}/checkpoints/${checkpoint.id}/fork`, {}));
  if (!dialog) return;
  await loadDialogs();
  await select(dialog.id);
}

async function loadUsage() {
  const dialog = state.current;
  if (!dialog) return;
  try {
    state.usage = await api('GET', `dialogs/${dialog.id}/usage`);
  } catch {
    state.usage = null;
  }
  renderCounters();
}

function renderCounters() {
  const dl = $('counters');
  dl.replaceChildren();
  if (!state.current) return;
  const item = (label, value, title) => dl.append(
    h('div', { class: 'counter', title }, h('dt', { text: label }), h('dd', { text: value })));
  const u = state.usage;
  const sub = runs.usage();
  if (u) {
    item('in', count(u.prompt_tokens), `${u.prompt_tokens} prompt tokens in this dialog's turns`);
    item('out', count(u.completion_tokens), `${u.completion_tokens} completion tokens in this dialog's turns`);
    item('calls', count(u.model_calls), `${u.model_calls} model calls`);
  }
  if (sub.runs) item('sub-agents', `${count(sub.tokens)} tok`, `${sub.tokens} tokens over ${sub.runs} sub-agent runs`);
}

// ── the WebSocket ─────────────────────────────────────────────────────────

async function subscribe() {
  const dialog = state.current;
  if (!dialog || !socket.open) return;
  try {
    const resume = state.lastEvent === null ? { join: true } : { resume_from: state.lastEvent };
    const answer = await socket.request({ type: 'subscribe', session_id: dialog.id, since_revision: state.revision, ...resume });
    if (state.current?.id === dialog.id) state.revision = Math.max(state.revision, answer.revision);
  } catch (e) {
    if (e.code !== 'closed') notify(`Live updates are off: ${e.message}`);
  }
}

/** Re-reads everything shown (after a reconnect or a resync). */
async function resync() {
  await attempt('Reloading', async () => {
    await loadDialogs();
    if (!state.current) return;
    await Promise.all([loadMessages(), loadCheckpoints(), loadUsage(), loadRuns(), loadEvents(), loadInbox(), loadApprovals(), refreshDialog()]);
  });
  updateComposer();
}

function onState(s, attempt) {
  const conn = $('connection');
  conn.dataset.state = s;
  conn.querySelector('.label').textContent = { open: 'live', closed: 'offline', connecting: 'connecting' }[s];
  const banner = $('banner');
  if (s === 'open') {
    banner.hidden = true;
    const reconnect = state.everOpen;
    state.everOpen = true;
    subscribe().then(() => (reconnect ? resync() : undefined));
  } else if (s === 'closed' && state.everOpen) {
    banner.replaceChildren(
      h('span', { text: `The live connection dropped. Reconnecting${attempt > 1 ? ` (attempt ${attempt})` : ''}…` }),
      h('button', { type: 'button', class: 'mini', text: 'Retry now', on: { click: () => socket.reconnect() } }));
    banner.hidden = false;
    // Turns that were streaming resume after the last frame seen on reconnect.
    updateComposer();
  }
}

function onFrame(f) {
  if (f.type === 'dialog_updated') {
    if (state.current?.id === f.dialog.id) showDialog(f.dialog);
    else {
      const i = state.dialogs.findIndex((d) => d.id === f.dialog.id);
      if (i >= 0) state.dialogs[i] = f.dialog;
      renderDialogs($('dialog-list'), state.dialogs, state.current?.id, select);
    }
    return;
  }
  if (!state.current || f.session_id !== state.current.id) return;
  if (typeof f.revision === 'number' && f.type !== 'resync') state.revision = Math.max(state.revision, f.revision);
  if (typeof f.event_id === 'number') state.lastEvent = Math.max(state.lastEvent ?? 0, f.event_id);
  switch (f.type) {
    case 'agent_run_updated':
      if (runs.run(f.run)) renderRuns();
      break;
    case 'agent_event_updated':
      if (runs.event(f.event)) {
        renderRuns();
        attempt('Reading the inbox', loadInbox);
      }
      break;
    case 'approval_requested':
      approvals.requested(f.approval);
      break;
    case 'approval_decided':
      approvals.decided(f.approval);
      chat.approvalDecided(f.approval);
      break;
    case 'resync':
      state.revision = 0;
      resync();
      break;
    case 'replay_gap':
      // The frames missed are gone: what is shown is re-read; the running
      // turn's frames (if still kept) follow this one.
      chat.live.clear();
      resync();
      break;
    case 'turn_started':
    case 'text_delta':
    case 'tool_started':
    case 'tool_finished':
    case 'notice':
    case 'turn_failed':
      chat.frame(f);
      updateComposer();
      break;
    case 'turn_committed':
      chat.frame(f);
      updateComposer();
      // The dialog itself (title, count) arrives as dialog_updated.
      Promise.all([loadMessages(), loadCheckpoints(), loadUsage()]);
      break;
    default:
  }
}

async function detectSteer() {
  try {
    const doc = await call('GET', 'openapi.json');
    const variants = doc?.components?.schemas?.ClientFrame?.oneOf ?? [];
    state.steer = variants.some((v) => v?.properties?.type?.enum?.includes('steer'));
  } catch {
    state.steer = false;
  }
}

// ── controls ──────────────────────────────────────────────────────────────

function setPanel(name) {
  document.body.dataset.panel = name;
  $('toggle-dialogs').setAttribute('aria-expanded', String(name === 'dialogs'));
  $('toggle-activity').setAttribute('aria-expanded', String(name === 'activity'));
}

function confirmAction(title, text, ok) {
  const dialog = $('confirm-dialog');
  $('confirm-title').textContent = title;
  $('confirm-text').textContent = text;
  $('confirm-ok').textContent = ok;
  return new Promise((resolve) => {
    $('confirm-form').onsubmit = () => resolve(true);
    dialog.onclose = () => resolve(false);
    dialog.showModal();
  });
}

function on(action, fn) {
  for (const b of document.querySelectorAll(`[data-action=${action}]`)) b.addEventListener('click', fn);
}

function wire() {
  // The token prompt stays until a token is given.
  $('token-dialog').addEventListener('cancel', (e) => e.preventDefault());
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    send();
  });
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  input.addEventListener('input', autosize);
  input.addEventListener('paste', (e) => {
    const files = [...(e.clipboardData?.files ?? [])];
    if (files.some((f) => f.type.startsWith('image/'))) {
      e.preventDefault();
      attachFiles(files);
    }
  });
  $('composer').addEventListener('dragover', (e) => {
    if ([...(e.dataTransfer?.items ?? [])].some((i) => i.kind === 'file')) e.preventDefault();
  });
  $('composer').addEventListener('drop', (e) => {
    if (!e.dataTransfer?.files?.length) return;
    e.preventDefault();
    attachFiles([...e.dataTransfer.files]);
  });
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Escape' && !document.querySelector('dialog[open]')) {
      if (chat.running) {
        e.preventDefault();
        stop();
      } else if (document.body.dataset.panel) setPanel('');
    }
  });
  $('stop').addEventListener('click', stop);
  $('new-dialog').addEventListener('click', () => attempt('Creating a dialog', createDialog).then(() => input.focus()));
  on('rename', () => {
    $('rename-input').value = state.current.title;
    $('rename-dialog').showModal();
  });
  $('rename-form').addEventListener('submit', async () => {
    const title = $('rename-input').value.trim();
    if (!title || !state.current) return;
    const dialog = await attempt('Renaming', () => api('PATCH', `dialogs/${state.current.id}`, { title }));
    if (dialog) showDialog(dialog);
  });
  $('agent-select').addEventListener('change', switchAgent);
  on('delete', async () => {
    const dialog = state.current;
    if (!(await confirmAction('Delete this dialog?', `“${dialog.title}” leaves the list and its running sub-agents are cancelled.`, 'Delete'))) return;
    if ((await attempt('Deleting', () => api('DELETE', `dialogs/${dialog.id}`))) === undefined) return;
    localStorage.removeItem(LAST_DIALOG);
    clearDialog();
    await loadDialogs();
    if (state.dialogs[0]) await select(state.dialogs[0].id);
  });
  for (const b of document.querySelectorAll('[data-close]')) {
    b.addEventListener('click', () => b.closest('dialog').close());
  }
  $('scrim').addEventListener('click', () => setPanel(''));
  $('toggle-dialogs').addEventListener('click', () => setPanel(document.body.dataset.panel === 'dialogs' ? '' : 'dialogs'));
  $('toggle-activity').addEventListener('click', () => setPanel(document.body.dataset.panel === 'activity' ? '' : 'activity'));
  window.addEventListener('hashchange', () => {
    const id = new URLSearchParams(location.hash.slice(1)).get('d');
    if (id && id !== state.current?.id) select(id);
  });
}

async function start() {
  wire();
  setPanel('');
  runs.render();
  await loadDialogs().catch((e) => notify(`Cannot list dialogs: ${e.message}`));
  loadAgents().catch((e) => notify(`Cannot list agents: ${e.message}`));
  detectSteer().then(updateComposer);
  socket.connect();
  const wanted = new URLSearchParams(location.hash.slice(1)).get('d') ?? localStorage.getItem(LAST_DIALOG);
  const shown = wanted && (await select(wanted));
  if (!shown && state.dialogs[0]) await select(state.dialogs[0].id);
  input.focus();
}

start();
