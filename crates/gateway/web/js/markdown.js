// Markdown of model output, rendered safely: marked turns it into HTML and
// DOMPurify removes everything that could run (script, event handlers,
// javascript: and other non-http links, forms, styles) before it touches the
// DOM. The page's Content-Security-Policy (no inline script, Trusted Types)
// is the second wall behind this one.
import { marked } from '../vendor/marked.esm.js';
import '../vendor/purify.min.js';

const DOMPurify = globalThis.DOMPurify;

const SANITIZE = {
  // Returned as TrustedHTML: the only value the page's CSP lets into innerHTML.
  RETURN_TRUSTED_TYPE: true,
  USE_PROFILES: { html: true },
  FORBID_TAGS: ['style', 'form', 'input', 'button', 'textarea', 'select', 'option', 'iframe',
    'object', 'embed', 'svg', 'math', 'template', 'dialog', 'video', 'audio', 'source'],
  FORBID_ATTR: ['style', 'class', 'id', 'name', 'srcset', 'action', 'formaction'],
  // Links and images: http(s), mailto and in-page anchors only.
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:|#)/i,
};

DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A' && node.hasAttribute('href')) {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer nofollow');
  }
});

marked.use({ gfm: true, breaks: false, async: false });

/** Renders `text` (Markdown) into `el`, sanitized. */
export function renderMarkdown(el, text) {
  const html = marked.parse(text ?? '');
  el.innerHTML = DOMPurify.sanitize(html, SANITIZE);
}
