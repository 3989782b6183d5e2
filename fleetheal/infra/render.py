"""`fleetheal render`: every object a stack would create, as YAML, one file per object.

The program runs under Pulumi's mock engine (no CLI, no cluster), so the output is exactly what
`pulumi up` would ask for. Files are deterministic (sorted keys, stable names, block-style scripts)
so a pull request shows a readable diff. Secret values never reach the files. `load_inputs` reads a
stack's objects back (rendering it now, or from a previous render) for `fleetheal fleet drift`.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from fleetheal.errors import UsageError
from fleetheal.infra import config, mocks, project

MARKER = ".fleetheal-render"
REDACTED = "<redacted>"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class RenderError(ValueError):
    """The output directory cannot be used (it holds files that are not a previous render)."""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Scripts and slurm.conf fragments read (and diff) line by line in block style.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _redact(rec: mocks.Recorded) -> dict[str, Any]:
    obj: dict[str, Any] = dict(rec.inputs)
    if obj.get("kind") == "Secret":
        for field in ("data", "stringData"):
            if isinstance(obj.get(field), dict):
                obj[field] = {k: REDACTED for k in obj[field]}
    for path in rec.secret_paths:
        _set_path(obj, path, REDACTED)
    return obj


def _set_path(obj: Any, path: str, value: Any) -> None:
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    node = obj
    for i, part in enumerate(parts):
        key: Any = int(part[1:-1]) if part.startswith("[") else part
        last = i == len(parts) - 1
        try:
            if last and isinstance(node[key], dict):
                node[key] = {k: value for k in node[key]}  # keep the keys a reviewer needs to see
            elif last:
                node[key] = value
            else:
                node = node[key]
        except (KeyError, IndexError, TypeError):
            return


def document(rec: mocks.Recorded) -> tuple[str, dict[str, Any]]:
    """(relative file path, object) for one recorded resource."""
    if rec.is_kubernetes_object and rec.type != mocks.HELM_RELEASE:
        obj = _redact(rec)
        md = obj.get("metadata") or {}
        folder = md.get("namespace") or "_cluster"
        kind = obj["kind"] + ("-patch" if rec.is_patch else "")
        return f"{_SAFE.sub('_', folder)}/{kind}-{_SAFE.sub('_', str(md.get('name', rec.name)))}.yaml", obj
    # Helm releases and cloud resources: the Pulumi type and inputs, which is what a reviewer diffs.
    obj = {"pulumiType": rec.type, "name": rec.name, "inputs": _redact(rec)}
    folder = "_helm" if rec.type == mocks.HELM_RELEASE else "_cloud"
    kind = rec.type.rsplit(":", 1)[-1]
    return f"{folder}/{kind}-{_SAFE.sub('_', rec.name)}.yaml", obj


def dump(obj: dict[str, Any], header: str) -> str:
    body = yaml.dump(obj, Dumper=_Dumper, sort_keys=True, default_flow_style=False, width=100, allow_unicode=True)
    return f"{header}---\n{body}"


def records_to_files(records: Iterable[mocks.Recorded], header: str) -> dict[str, str]:
    files: dict[str, str] = {}
    for rec in records:
        if not rec.custom:
            continue  # component resources have no object of their own
        rel, obj = document(rec)
        if rel in files:
            raise RenderError(f"two resources render to {rel}; object names must be unique per kind and namespace")
        files[rel] = dump(obj, header)
    return dict(sorted(files.items()))


def record_stack(stack: str, root: Path = project.REPO_ROOT) -> list[mocks.Recorded]:
    """Every resource registration of `stack` (Pulumi.yaml + Pulumi.<stack>.yaml) under the mock engine."""
    from fleetheal.infra import program

    cfg = config.from_values(project.stack_values(stack, root), root / "Pulumi.yaml")
    return mocks.run(lambda: program.build(cfg), stack=stack)


def render_stack(
    stack: str, root: Path = project.REPO_ROOT, records: list[mocks.Recorded] | None = None
) -> dict[str, str]:
    """Relative path -> YAML text for every object of `stack`."""
    if records is None:
        records = record_stack(stack, root)
    header = (
        f"# Rendered by `fleetheal render --stack {stack}` from Pulumi.yaml and Pulumi.{stack}.yaml.\n"
        "# Do not edit: change the stack config or the components and render again.\n"
    )
    return records_to_files(records, header)


def write(files: dict[str, str], out: Path) -> None:
    """Replace the contents of `out` with `files` (only if `out` is empty or a previous render)."""
    write_stacks({"": files}, out)


def write_stacks(stacks: dict[str, dict[str, str]], out: Path) -> None:
    """Replace the contents of `out` with each stack's files in `out/<stack>/` (a stack named "" in `out`
    itself); only if `out` is empty or a previous render. Every rendered directory carries MARKER, so
    `fleetheal fleet drift` can read a federation's renders back."""
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise RenderError(f"{out} is not empty and is not a previous render (no {MARKER}); choose an empty directory")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("fleetheal render output; the whole directory is rewritten on each render\n")
    for stack, files in stacks.items():
        where = out / stack if stack else out
        where.mkdir(parents=True, exist_ok=True)
        if stack:
            (where / MARKER).write_text(f"fleetheal render output of stack {stack}\n")
        for rel, text in files.items():
            path = where / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# reading stacks back: stack files, project directories, rendered directories


def render_objects(stack: str, root: Path) -> list[dict[str, Any]]:
    """The Kubernetes objects (Helm releases aside) that `stack` of the project at `root` would create."""
    records = record_stack(stack, root)
    return [r.inputs for r in records if r.custom and r.is_kubernetes_object and r.type != mocks.HELM_RELEASE]


def _rendered_dir_objects(path: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(path.rglob("*.yaml")):
        if f.relative_to(path).parts[0] in ("_helm", "_cloud"):
            continue
        for doc in yaml.safe_load_all(f.read_text(encoding="utf-8")):
            if isinstance(doc, dict) and "kind" in doc:
                out.append(doc)
    return out


def load_inputs(paths: Sequence[Path]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(source name, objects) of each stack the paths name. A path is a stack file (`Pulumi.<stack>.yaml`,
    rendered now), a project directory (each of its stacks whose federation role is not `none`), or the
    output of `fleetheal render` (one stack, or one per sub-directory)."""
    out: list[tuple[str, list[dict[str, Any]]]] = []
    for path in paths:
        if path.is_file():
            m = re.fullmatch(r"Pulumi\.(.+)\.yaml", path.name)
            if not m or not (path.parent / "Pulumi.yaml").is_file():
                raise UsageError(f"{path}: not a stack file (Pulumi.<stack>.yaml beside a Pulumi.yaml)")
            out.append((m.group(1), render_objects(m.group(1), path.parent)))
        elif (path / MARKER).is_file():
            subs = sorted(d for d in path.iterdir() if (d / MARKER).is_file())
            for d in subs or [path]:
                out.append((str(d), _rendered_dir_objects(d)))
        elif (path / "Pulumi.yaml").is_file():
            for stack in project.list_stacks(path):
                raw = project.stack_values(stack, path).get("federation") or {}
                if isinstance(raw, dict) and raw.get("role", "none") != "none":
                    out.append((stack, render_objects(stack, path)))
        elif path.is_dir():
            raise UsageError(f"{path}: neither a Pulumi project (no Pulumi.yaml) nor a render (no {MARKER})")
        else:
            raise UsageError(f"{path}: no such file or directory")
    return out
