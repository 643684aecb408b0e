// Small DOM helpers: elements are built with the DOM API (never from HTML
// strings), so text from the server can only ever be text.

/**
 * Creates an element. `props`: `class`, `text`, `on: {event: fn}`,
 * `data: {key: value}`, attributes (`aria-*`, `title` …); `hidden`,
 * `disabled` and `open` are set as properties. Children are nodes or strings.
 */
export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'class') el.className = value;
    else if (key === 'text') el.textContent = value;
    else if (key === 'on') for (const [ev, fn] of Object.entries(value)) el.addEventListener(ev, fn);
    else if (key === 'data') for (const [k, v] of Object.entries(value)) el.dataset[k] = v;
    else if (key === 'hidden' || key === 'disabled' || key === 'open') el[key] = true;
    else el.setAttribute(key, value === true ? '' : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
}

/** An SVG element with attributes. */
export function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  append(el, children);
  return el;
}

/** Replaces the children of `el`. */
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

export const $ = (id) => document.getElementById(id);
