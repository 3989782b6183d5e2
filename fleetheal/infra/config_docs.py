"""docs/pulumi-config.md, generated from the declarations in Pulumi.yaml (tests/infra/test_config.py checks it
is current)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleetheal.infra.project import PROJECT_FILE, declarations


def reference_markdown(project_file: Path = PROJECT_FILE) -> str:
    """docs/pulumi-config.md, generated from the declarations in Pulumi.yaml (a test checks it is current)."""

    def show(value: Any) -> str:
        if value is None:
            return ""
        return "`" + json.dumps(value, separators=(", ", ": ")) + "`"

    lines = [
        "# Stack configuration reference",
        "",
        "<!-- GENERATED from Pulumi.yaml by fleetheal.infra.config_docs.reference_markdown(); do not edit. -->",
        "",
        "Every setting of the fleetheal Pulumi program, declared once in `Pulumi.yaml`. A stack file",
        "(`Pulumi.<stack>.yaml`) only overrides: `pulumi config set fleetheal:KEY VALUE` (`--path` for",
        "objects and lists, `--secret` for secrets). A bad value stops `pulumi up` before any resource is",
        "registered, with a message naming `fleetheal:KEY` and what it accepts.",
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
    ]
    for d in declarations(project_file).values():
        typ = f"{d.type}<{d.items}>" if d.items else d.type
        if d.secret:
            typ += " (secret)"
        default = show(d.default) if d.has_default else "(none)"
        desc = d.description.replace("|", "\\|")
        lines.append(f"| `{d.key}` | {typ} | {default} | {desc} |")
    return "\n".join(lines) + "\n"
