"""Approvals: what waits for a person's yes, and how it is decided, exactly once.

- `rules`: the one rule (pure): which request needs whose approval (`rule_for`), the
  built-in family defaults, the effective rules per group;
- `cards`: what a card says: the stored request, every argument escaped (control
  characters, ANSI escapes, bidi marks shown as escapes), long values cut;
- `store`: the `approvals` table and its codes: pending rows, a decision as a conditional
  UPDATE (one wins), expiry, wrong-code lockout, listing;
- `flow`: opening an approval with its cards (in the requesting command's transaction), and
  deciding one: what the decision's transaction does at once (an action job released, an
  admitted sender), and what the daemon's settle pass does after (notes to the agent, the
  cards edited to show the outcome).

The IPC engine (mdclaw.ipc.apply) asks `rule_for` for every command and action and opens an
approval instead of applying it; it also settles decided approvals (an approved command runs
there, from the stored request). People decide through their channel (mdclaw.decisions),
the operator through the CLI or the operator page (mdclaw.ops.approvals). docs/approvals.md
says it in words.
"""
