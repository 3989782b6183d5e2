"""Importing the agent, and building the `fleetheal` command it runs under, stays lean: no Pulumi, Ansible,
aiohttp or jsonschema (STYLE.md, "Layout")."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("pulumi", "ansible", "ansible_runner", "aiohttp", "jsonschema", "kubernetes")


def test_agent_modules_import_nothing_heavy():
    code = (
        "import sys\n"
        "import fleetheal.agent.service, fleetheal.agent.cli, fleetheal.agent.metrics, fleetheal.agent.client\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_fleetheal_command_registers_without_importing_anything_heavy():
    """`fleetheal agent check` on a node builds the whole parser first: registration stays cheap (CONTRIBUTING,
    "CLI"); a module-level import of jsonschema in a config module once made it 60 ms slower."""
    code = (
        "import sys\n"
        "import fleetheal.cli\n"
        "fleetheal.cli.build_parser()\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
