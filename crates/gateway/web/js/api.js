// The client of keel serve's public API: REST under api/ and the WebSocket
// api/ws (docs/PROTOCOL.md). The access token, when the server wants one,
// lives in sessionStorage: it is sent as a bearer header, and as
// ?access_token= to the WebSocket, which cannot carry headers.

const TOKEN_KEY = 'keel.token';

/** A request the server refused; `status` and `code` as in its problem body. */
export class ApiError extends Error {
  constructor(status, code, detail) {
    super(detail || `HTTP ${status}`);
    this.status = status;
    this.code = code;
  }
}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (t) => sessionStorage.setItem(TOKEN_KEY, t),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

const base = new URL('api/', document.baseURI);

/** Calls the REST API; resolves to the JSON body (null for 204). */
export async function call(method, path, body) {
  const headers = { accept: 'application/json' };
  const t = token.get();
  if (t) headers.authorization = `Bearer ${t}`;
  if (body !== undefined) headers['content-type'] = 'application/json';
  let response;
  try {
    response = await fetch(new URL(path, base), {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
    });
  } catch (e) {
    throw new ApiError(0, 'network', `the server cannot be reached (${e.message})`);
  }
  if (response.status === 204) return null;
  const json = await response.json().catch(() => null);
  if (!response.ok) {
    throw new ApiError(response.status, json?.code ?? 'http', json?.detail ?? response.statusText);
  }
  return json;
}

/**
 * A stored image (`/api/images/{sha256}`, behind the token) as a data: URL:
 * the page's Content-Security-Policy lets images come from nowhere else.
 */
export async function imageDataUrl(path) {
  const headers = {};
  const t = token.get();
  if (t) headers.authorization = `Bearer ${t}`;
  const response = await fetch(new URL(path.replace(/^\/api\//, ''), base), { headers });
  if (!response.ok) throw new ApiError(response.status, 'http', response.statusText);
  const blob = await response.blob();
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

export const get = (path) => call('GET', path);
export const post = (path, body = {}) => call('POST', path, body);

/**
 * The WebSocket, reconnecting with backoff. `onFrame(frame)` gets every
 * server frame; `onState('open' | 'closed' | 'connecting', attempt)` the
 * connection's changes; `request(frame)` sends a client frame and resolves
 * to its answer (matched by `id`).
 */
export class Socket {
  constructor({ onFrame, onState }) {
    this.onFrame = onFrame;
    this.onState = onState;
    this.pending = new Map();
    this.nextId = 1;
    this.attempt = 0;
    this.ws = null;
    this.stopped = false;
  }

  connect() {
    this.stopped = false;
    const url = new URL('ws', base);
    url.protocol = url.protocol === 'https:' ? 'wss:' : 'ws:';
    const t = token.get();
    if (t) url.searchParams.set('access_token', t);
    this.onState('connecting', this.attempt);
    const ws = new WebSocket(url);
    this.ws = ws;
    ws.addEventListener('open', () => {
      this.attempt = 0;
      this.onState('open', 0);
    });
    ws.addEventListener('message', (e) => {
      let frame;
      try {
        frame = JSON.parse(e.data);
      } catch {
        return;
      }
      const waiting = frame.id && this.pending.get(frame.id);
      if (waiting) {
        this.pending.delete(frame.id);
        if (frame.type === 'error') waiting.reject(new ApiError(frame.status, frame.code, frame.detail));
        else waiting.resolve(frame);
      }
      this.onFrame(frame);
    });
    ws.addEventListener('close', () => {
      if (this.ws !== ws) return;
      this.ws = null;
      for (const p of this.pending.values()) p.reject(new ApiError(0, 'closed', 'the connection closed'));
      this.pending.clear();
      if (this.stopped) return;
      this.attempt += 1;
      this.onState('closed', this.attempt);
      const delay = Math.min(10000, 500 * 2 ** Math.min(this.attempt - 1, 5));
      this.timer = setTimeout(() => this.connect(), delay);
    });
  }

  /** Reconnects now (after a token change, or when the user asks). */
  reconnect() {
    clearTimeout(this.timer);
    const old = this.ws;
    this.ws = null;
    if (old) old.close();
    this.connect();
  }

  get open() {
    return this.ws?.readyState === WebSocket.OPEN;
  }

  /** Sends `frame` with a fresh id; resolves to its answer. */
  request(frame) {
    if (!this.open) return Promise.reject(new ApiError(0, 'closed', 'not connected'));
    const id = `c${this.nextId++}`;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.ws.send(JSON.stringify({ ...frame, id }));
    });
  }
}
