"""The remediator: Alertmanager webhook -> durable incidents -> one safety gate -> remediation playbooks.

Modules: config (settings), alerts (payload validation), store (SQLite), gate (safety), engine (incident
state machine), runner (ansible-runner, the only importer of it), metrics, app (aiohttp), cli.
See docs/remediator.md.
"""
