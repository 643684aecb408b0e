// The dialog list of the sidebar.
import { h, replace } from './dom.js';
import { clock } from './format.js';

/** Renders `dialogs` (newest first) with `current` marked. */
export function renderDialogs(list, dialogs, current, onSelect) {
  replace(list, ...dialogs.map((d) => h('li', {},
    h('a', {
      href: `#d=${d.id}`,
      class: 'dialog-link',
      'aria-current': d.id === current ? 'page' : undefined,
      data: { dialogId: d.id },
      on: { click: (e) => { e.preventDefault(); onSelect(d.id); } },
    },
    h('span', { class: 'dialog-name', text: d.title }),
    h('span', { class: 'dialog-meta', text: `${d.message_count} msg · ${clock(d.last_active_at)}` })))));
  if (dialogs.length === 0) list.append(h('li', { class: 'muted small', text: 'No dialogs yet.' }));
}
