"""The fleetheal stack under the real Pulumi engine: `preview` (with policy packs), `up`, `destroy`.

Pulumi's Python language host (`pulumi-language-python`) is not among the tools `make tools` builds
(the Go module proxy refuses its module), so the program runs inline through the Automation API:
`pulumi.automation` serves the language protocol from this process and drives the real `pulumi` CLI
(`pulumi up --exec-kind auto.inline`), which runs `pulumi/__main__.py` here via `runpy`.

Everything the engine writes lives under one backend directory::

    BACKEND/.pulumi/     the file backend's state (PULUMI_BACKEND_URL=file://BACKEND)
    BACKEND/workspace/   the project's Pulumi.yaml and Pulumi.STACK.yaml, copied; Pulumi writes here only
    BACKEND/home/        PULUMI_HOME: an empty plugin cache, so nothing is downloaded

The workspace copy of Pulumi.yaml gains a `plugins: providers:` entry pointing at the directory holding
`pulumi-resource-kubernetes`, so the engine loads that binary for whatever version the Kubernetes SDK
asks for, and automatic plugin acquisition is off. The committed Pulumi.STACK.yaml is never written:
the copy starts from it on every run (keeping its own encryption salt) and then gets the run's
overrides (`settings`, `secrets`, encrypted with PULUMI_CONFIG_PASSPHRASE). A Python policy pack is
handed to the engine as an executable (see `policy_launchers`) that starts it with
`tools/pulumi-analyzer-policy-python`.
"""

from __future__ import annotations

import json
import os
import runpy
import shlex
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pulumi import automation as auto

from fleetheal.infra import project

PROGRAM = project.REPO_ROOT / "pulumi" / "__main__.py"
POLICY_PACK = project.REPO_ROOT / "policies"
#: Starts a Python policy pack (the `pulumi-analyzer-policy-python` plugin convention).
ANALYZER_SHIM = project.REPO_ROOT / "tools" / "pulumi-analyzer-policy-python"
#: What must be in the tools' bin directory (`make tools` builds both).
BINARIES = ("pulumi", "pulumi-resource-kubernetes")
_NO_CHANGE = ("same",)


class EngineError(RuntimeError):
    """The tools are missing or the stack cannot be set up (a failed engine run raises auto.CommandError)."""


@dataclass(frozen=True)
class Target:
    """One stack of the fleetheal project in one backend, deployed into the cluster of `kubeconfig`.

    Args:
        stack: stack name; its starting config is the committed `Pulumi.<stack>.yaml` (if any).
        kubeconfig: the cluster the Kubernetes provider talks to (its KUBECONFIG).
        backend: file-backend directory (created), also holding the workspace and PULUMI_HOME.
        bin_dir: directory with `pulumi` and `pulumi-resource-kubernetes` (`make tools`: .tools/bin).
        passphrase: the stack's secrets passphrase (PULUMI_CONFIG_PASSPHRASE).
        settings: overrides by bare key (`awaitReadiness`), as Pulumi config strings (JSON for objects).
        secrets: secret overrides by bare key (`slurmKey`), stored encrypted in the workspace copy.
    """

    stack: str
    kubeconfig: Path
    backend: Path
    bin_dir: Path
    passphrase: str
    settings: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, str] = field(default_factory=dict)

    @property
    def work_dir(self) -> Path:
        return self.backend / "workspace"

    @property
    def pulumi_home(self) -> Path:
        return self.backend / "home"


def missing_tools(bin_dir: Path) -> list[str]:
    """The binaries `bin_dir` lacks (empty when `make tools` has built them)."""
    return [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]


def changes(counts: Mapping[Any, int] | None) -> int:
    """Resource operations in a preview's change summary or an update's resource changes, `same` excluded."""
    return sum(n for op, n in (counts or {}).items() if str(getattr(op, "value", op)) not in _NO_CHANGE)


def _project_file(target: Target) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((project.REPO_ROOT / "Pulumi.yaml").read_text(encoding="utf-8"))
    doc["main"] = str((project.REPO_ROOT / doc.get("main", ".")).resolve())
    runtime = doc.get("runtime")
    options = runtime.get("options") if isinstance(runtime, dict) else None
    if isinstance(options, dict) and options.get("virtualenv"):
        options["virtualenv"] = str((project.REPO_ROOT / options["virtualenv"]).resolve())
    doc["plugins"] = {"providers": [{"name": "kubernetes", "path": str(target.bin_dir.resolve())}]}
    return doc


def _stack_file(target: Target) -> dict[str, Any]:
    source = project.REPO_ROOT / f"Pulumi.{target.stack}.yaml"
    doc: dict[str, Any] = {}
    if source.exists():
        doc = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
    doc.pop("encryptionsalt", None)
    # Objects and arrays go into the file: `pulumi config set` would store them as strings, which the
    # engine refuses for keys Pulumi.yaml declares as objects (gpuPools).
    structured = {k: v for k, v in target.settings.items() if _structured(v)}
    if structured:
        doc["config"] = {
            **(doc.get("config") or {}),
            **{f"{project.PROJECT}:{k}": json.loads(v) for k, v in structured.items()},
        }
    copy = target.work_dir / source.name
    if copy.exists():
        previous = yaml.safe_load(copy.read_text(encoding="utf-8")) or {}
        if "encryptionsalt" in previous:
            doc["encryptionsalt"] = previous["encryptionsalt"]
    return doc


def _structured(value: str) -> bool:
    return value.lstrip()[:1] in ("[", "{")


def prepare(target: Target) -> Path:
    """Write the workspace: Pulumi.yaml with the provider plugin path, Pulumi.<stack>.yaml from the committed one."""
    missing = missing_tools(target.bin_dir)
    if missing:
        raise EngineError(
            f"{', '.join(missing)} not found in {target.bin_dir}: run `make tools` (scripts/build-tools.sh)"
        )
    if not target.kubeconfig.is_file():
        raise EngineError(f"kubeconfig {target.kubeconfig} does not exist")
    for d in (target.work_dir, target.pulumi_home):
        d.mkdir(parents=True, exist_ok=True)
    stack_doc = _stack_file(target)
    (target.work_dir / "Pulumi.yaml").write_text(yaml.safe_dump(_project_file(target), sort_keys=False))
    (target.work_dir / f"Pulumi.{target.stack}.yaml").write_text(yaml.safe_dump(stack_doc, sort_keys=False))
    return target.work_dir


def env_vars(target: Target) -> dict[str, str]:
    """The engine's environment on top of this process's."""
    return {
        "PULUMI_BACKEND_URL": f"file://{target.backend.resolve()}",
        "PULUMI_CONFIG_PASSPHRASE": target.passphrase,
        "KUBECONFIG": str(target.kubeconfig.resolve()),
        "PULUMI_SKIP_UPDATE_CHECK": "true",
        "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",
        "PULUMI_DISABLE_REGISTRY_RESOLVE": "true",
        "PULUMI_DIY_BACKEND_NO_LEGACY_WARNING": "true",
    }


def _program() -> None:
    runpy.run_path(str(PROGRAM))


def open_stack(target: Target) -> auto.Stack:
    """Create or select the stack and apply the run's config overrides."""
    work_dir = prepare(target)
    command = auto.PulumiCommand(root=str(target.bin_dir.resolve().parent))
    if Path(command.command) != target.bin_dir.resolve() / "pulumi":
        raise EngineError(f"the Automation API runs {command.command}, not {target.bin_dir / 'pulumi'}")
    stack = auto.create_or_select_stack(
        stack_name=target.stack,
        project_name=project.PROJECT,
        program=_program,
        opts=auto.LocalWorkspaceOptions(
            work_dir=str(work_dir),
            pulumi_home=str(target.pulumi_home),
            env_vars=env_vars(target),
            pulumi_command=command,
        ),
    )
    values = {f"{project.PROJECT}:{k}": auto.ConfigValue(v) for k, v in target.settings.items() if not _structured(v)}
    values |= {f"{project.PROJECT}:{k}": auto.ConfigValue(v, secret=True) for k, v in target.secrets.items()}
    if values:
        stack.set_all_config(values)
    return stack


OnOutput = Callable[[str], Any]


def _paths(paths: Iterable[Path]) -> list[str]:
    return [str(p.resolve()) for p in paths]


def policy_launchers(target: Target, packs: Sequence[Path]) -> list[Path]:
    """An executable per policy pack directory, which the engine runs as a binary analyzer plugin.

    Pulumi 3.274 starts a directory policy pack only through its runtime's language plugin
    (`pulumi-language-python`, not built here); a pack given as an executable file it runs itself, as
    `EXE ENGINE_ADDRESS` (reading a PulumiPolicy.yaml beside it for the pack's version). Each launcher
    sits beside a copy of the pack's PulumiPolicy.yaml and hands over to `tools/pulumi-analyzer-policy-python`
    the way older engines start a `pulumi-analyzer-policy-<runtime>` plugin: in the pack's folder, with
    `ENGINE_ADDRESS .` and one `-OPTION=VALUE` per runtime option.
    """
    out: list[Path] = []
    for i, given in enumerate(packs):
        pack = given.resolve()
        project = pack / "PulumiPolicy.yaml"
        if not project.is_file():
            raise EngineError(f"policy pack {pack}: no PulumiPolicy.yaml there")
        doc = yaml.safe_load(project.read_text(encoding="utf-8")) or {}
        runtime = doc.get("runtime")
        name = runtime.get("name") if isinstance(runtime, dict) else runtime
        if name != "python":
            raise EngineError(f"policy pack {pack}: runtime {name!r}; only Python packs can be started here")
        options = (runtime.get("options") if isinstance(runtime, dict) else None) or {}
        flags = " ".join(shlex.quote(f"-{k}={v}") for k, v in options.items() if str(v))
        folder = target.work_dir / "policy-packs" / f"{i}-{pack.name}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(project, folder / "PulumiPolicy.yaml")
        launcher = folder / "analyzer"
        launcher.write_text(
            "#!/bin/sh\n"
            f"# Written by fleetheal.infra.engine: starts the policy pack in {pack}.\n"
            f'cd {shlex.quote(str(pack))} && exec {shlex.quote(str(ANALYZER_SHIM))} "$1" . {flags}\n'
        )
        launcher.chmod(0o755)
        out.append(launcher)
    return out


def preview(
    target: Target,
    policy_packs: Sequence[Path] = (),
    policy_pack_configs: Sequence[Path] = (),
    on_output: OnOutput | None = None,
    on_error: OnOutput | None = None,
    *,
    diff: bool = False,
) -> auto.PreviewResult:
    """`pulumi preview [--policy-pack DIR ...] [--diff]`; raises auto.CommandError on a failure or a mandatory
    violation."""
    stack = open_stack(target)
    return stack.preview(
        policy_packs=_paths(policy_launchers(target, policy_packs)) or None,
        policy_pack_configs=_paths(policy_pack_configs) or None,
        diff=diff,
        color="never",
        on_output=on_output,
        on_error=on_error,
    )


def up(
    target: Target,
    policy_packs: Sequence[Path] = (),
    policy_pack_configs: Sequence[Path] = (),
    on_output: OnOutput | None = None,
    on_error: OnOutput | None = None,
) -> auto.UpResult:
    """`pulumi up --yes [--policy-pack DIR ...]`."""
    stack = open_stack(target)
    return stack.up(
        policy_packs=_paths(policy_launchers(target, policy_packs)) or None,
        policy_pack_configs=_paths(policy_pack_configs) or None,
        color="never",
        on_output=on_output,
        on_error=on_error,
    )


def destroy(target: Target, on_output: OnOutput | None = None, on_error: OnOutput | None = None) -> auto.DestroyResult:
    """`pulumi destroy --yes`: every resource of the stack (retained ones are left in the cluster)."""
    return open_stack(target).destroy(color="never", on_output=on_output, on_error=on_error)
