"""Shared queries and actions: what the command line (mdclaw.commands), the operator page
(mdclaw.operator) and the daemon (mdclaw.daemon) all use, defined once, below all three.

One module per concern: `database` (the state database's readiness, for people), `status`
(how the daemon and its data are), `doctor` (every check of "will the assistant answer?"),
`groups`, `budgets`, `tasks`, `outbox` and `quarantine` (their listings, JSON shapes and
changes), `whatsapp` (the link state), `email` (the mail servers as status, doctor and
check-config see them), `console` (loading the config for a command, failing
with a message) and `view` (`DaemonView`: what the page and /metrics may see of the running
daemon). Nothing here parses arguments or serves HTTP.
"""
