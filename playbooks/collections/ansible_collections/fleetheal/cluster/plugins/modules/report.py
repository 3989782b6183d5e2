#!/usr/bin/python
"""fleetheal.cluster.report: write a remediation run's JSON report for one incident."""

from __future__ import annotations

import json
import os
import tempfile

from ansible_collections.fleetheal.cluster.plugins.module_utils.steps import run_module

DOCUMENTATION = r"""
module: report
short_description: Write the JSON report of one incident's remediation run
description:
  - Writes O(content) as indented JSON to O(dir)/O(name) (mode 0640; O(dir) is made, mode 0750, when missing),
    through a temporary file renamed into place, so a reader never sees half a report.
  - Runs in the controller through the collection's action plugin, as every fleetheal.cluster module does, so
    a run over many incidents writes each host's report without a new interpreter per host
    (C(ansible.builtin.copy) starts two).
  - Rewriting a report is not a change to the cluster, so the task never reports C(changed).
extends_documentation_fragment: [fleetheal.cluster.common]
options:
  dir: {description: The report directory., type: path, required: true}
  name: {description: The file name (no directory part)., type: str, required: true}
  content: {description: The report., type: dict, required: true}
"""

EXAMPLES = r"""
- name: Write the report
  fleetheal.cluster.report:
    dir: /var/lib/fleetheal/reports
    name: inc-000001-isolate_and_relocate.json
    content: "{{ __fleetheal_report }}"
"""

RETURN = r"""
path:
  description: The report's path.
  type: str
  returned: success
"""

ARGUMENT_SPEC = {
    "dir": {"type": "path", "required": True},
    "name": {"type": "str", "required": True},
    "content": {"type": "dict", "required": True},
}


def main() -> None:
    run_module(ARGUMENT_SPEC, work)


def work(steps, settings, p, dry):
    name = p["name"]
    if not name or os.sep in name or name in (".", ".."):
        raise ValueError(f"report name {name!r}: a file name, without a directory")
    os.makedirs(p["dir"], mode=0o750, exist_ok=True)
    path = os.path.join(p["dir"], name)
    fd, tmp = tempfile.mkstemp(dir=p["dir"], prefix=f".{name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(p["content"], f, indent=4, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o640)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return [], {"path": path}


if __name__ == "__main__":
    main()
