// Approval cards: one per tool call of the shown dialog that waits for a
// person (docs/PROTOCOL.md, "Approvals"). Each shows the tool, the agent
// and turn that asked and the arguments as text, with Approve, Always and
// Deny (with an optional reason). The server decides what is pending: the
// cards come from `approval_requested` live and from the pending list on
// load, and leave on `approval_decided`.
import { h, replace } from './dom.js';
import { clock, short } from './format.js';

export class ApprovalsView {
  /** `onDecide(approval, decision, reason)` resolves when the server took it, rejects with its problem. */
  constructor(container, onDecide) {
    this.container = container;
    this.onDecide = onDecide;
    this.cards = new Map();
  }

  /** Shows exactly these pending approvals (the server's list). */
  showPending(items) {
    this.cards.clear();
    replace(this.container);
    for (const a of items) this.requested(a);
    this.update();
  }

  /** Clears every card (another dialog is shown). */
  reset() {
    this.showPending([]);
  }

  /** Adds the card of a pending approval (once). */
  requested(a) {
    if (a.status !== 'pending' || this.cards.has(a.id)) return;
    const card = this.card(a);
    this.cards.set(a.id, card);
    this.container.append(card);
    this.update();
  }

  /** Removes the card of an approval that was decided (here or elsewhere). */
  decided(a) {
    const card = this.cards.get(a.id);
    if (!card) return;
    this.cards.delete(a.id);
    card.remove();
    this.update();
  }

  update() {
    this.container.hidden = this.cards.size === 0;
  }

  card(a) {
    const args = typeof a.arguments === 'string' ? a.arguments : JSON.stringify(a.arguments ?? {}, null, 2);
    const problem = h('p', { class: 'approval-problem', role: 'alert', hidden: true });
    const reason = h('input', {
      type: 'text', class: 'approval-reason', placeholder: 'Reason (optional, the model reads it)',
      'aria-label': `Reason to deny ${a.tool}`, maxlength: '2000',
    });
    const buttons = [];
    const decide = async (decision) => {
      for (const b of buttons) b.disabled = true;
      problem.hidden = true;
      try {
        const why = decision === 'deny' ? reason.value.trim() : '';
        await this.onDecide(a, decision, why || undefined);
        card.dataset.state = 'decided';
      } catch (e) {
        problem.textContent = `Not decided: ${e.message}`;
        problem.hidden = false;
        // Already decided (409) or gone (404): asking again cannot help.
        if (e.status === 409 || e.status === 404) card.dataset.state = 'stale';
        else for (const b of buttons) b.disabled = false;
      }
    };
    const button = (text, decision, cls, title) => {
      const b = h('button', { type: 'button', class: cls, text, title, data: { decision }, on: { click: () => decide(decision) } });
      buttons.push(b);
      return b;
    };
    const card = h('section', { class: 'approval', data: { approval: a.id, state: 'pending' }, 'aria-label': `Approval for ${a.tool}` },
      h('div', { class: 'approval-head' },
        h('span', { class: 'approval-title', text: 'Approval needed' }),
        h('code', { class: 'approval-tool', text: a.tool }),
        h('span', {
          class: 'approval-who',
          text: a.run_id ? `asked by ${a.agent} (run ${short(a.run_id)})` : `asked by ${a.agent}`,
        }),
        h('span', { class: 'approval-id', title: `approval ${a.id}, turn ${a.turn_id}`, text: `#${short(a.id)}` }),
        a.created_at ? h('span', { class: 'approval-time', text: clock(a.created_at) }) : null),
      h('pre', { class: 'approval-args', text: args }),
      h('div', { class: 'approval-actions' },
        button('Approve', 'approve', 'primary', 'Run this call once'),
        button('Always', 'approve_always', '', `Run this call and every later ${a.tool} call in this dialog without asking`),
        reason,
        button('Deny', 'deny', 'danger', 'Do not run it; the model reads the reason')),
      problem);
    reason.addEventListener('keydown', (e) => {
      if (e.key === 'Enter') {
        e.preventDefault();
        decide('deny');
      }
    });
    return card;
  }
}
