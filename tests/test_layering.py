"""No module of fleetheal imports one above it: bottom (shared names and helpers) < middle (the parts) < top
(the lab and the `fleetheal` command). Every import counts: at module level, inside functions (lazy) and under
TYPE_CHECKING, and `importlib.import_module` / `__import__` of a literal name."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fleetheal"

BOTTOM, MIDDLE, TOP = 0, 1, 2
NAMES = {BOTTOM: "bottom", MIDDLE: "middle", TOP: "top"}
#: The bottom layer, listed by name: names, data and small helpers every part may use, importing nothing
#: but each other. A package listed here takes its submodules with it.
BOTTOM_MODULES = (
    "fleetheal",  # the package itself: __version__
    "fleetheal.contracts",  # names shared by the parts
    "fleetheal.taxonomy",  # the fault taxonomy and its loader
    "fleetheal.errors",  # UsageError, which every part's command raises
    "fleetheal.settings",  # one settings file + environment overrides, for every service
    "fleetheal.logs",  # the one JSON log format
    "fleetheal.wait",  # the one poll loop
    "fleetheal.rate",  # the one token bucket
    "fleetheal.httpjson",  # JSON over HTTP, standard library
    "fleetheal.connguard",  # the servers' guard against slow and idle clients
    "fleetheal.tools",  # where `make tools` puts its programs
)
#: The top layer: the lab (it drives every part) and the `fleetheal` command (it dispatches to every part).
TOP_MODULES = ("fleetheal.lab", "fleetheal.cli", "fleetheal.__main__")
#: What runs on the nodes and in the cluster, from the wheel, which has no lab (tests/test_wheel.py). Whatever
#: the layers become, these never import the lab's test doubles and simulators.
DEPLOYABLE = (
    "fleetheal.agent",
    "fleetheal.remediator",
    "fleetheal.steps",
    "fleetheal.slurm",
    "fleetheal.fleet",
    "fleetheal.infra",
)
LAB = "fleetheal.lab"
# Anything else is a part (agent, remediator, infra, logparse, classify, slurm, steps, launch, procs,
# generate, ettr, ...): the middle layer, which is also where a new top-level module lands by default.


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or (p != "fleetheal" and name.startswith(p + ".")) for p in prefixes)


def layer(module: str) -> int:
    """A module's layer, decided by its package prefix."""
    if _within(module, TOP_MODULES):
        return TOP
    if _within(module, BOTTOM_MODULES):
        return BOTTOM
    return MIDDLE


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Every Python module of the package (the playbooks' Ansible plugins are not Python the package imports)."""
    return {
        module_name(p): p
        for p in sorted(PACKAGE.rglob("*.py"))
        if "playbooks" not in p.relative_to(PACKAGE).parts and "__pycache__" not in p.parts
    }


MODULES = _modules()


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, fleetheal module) for every import of a fleetheal module in `path`."""
    importer = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, path.name == "__init__.py", node)
            # `from fleetheal import contracts` imports the module fleetheal.contracts
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base) for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name == "fleetheal" or name.startswith("fleetheal.")]


def test_the_layers_cover_real_modules() -> None:
    assert len(MODULES) > 50, sorted(MODULES)  # the walk found the package
    for name in (*BOTTOM_MODULES, *TOP_MODULES):
        assert any(_within(m, (name,)) for m in MODULES), f"{name} is listed in a layer but is no module of fleetheal"
    assert layer("fleetheal.lab.demo") == TOP and layer("fleetheal.contracts") == BOTTOM
    assert layer("fleetheal.remediator.store.db") == MIDDLE and layer("fleetheal.something_new") == MIDDLE
    assert (
        layer("fleetheal.slurm.runner") == MIDDLE
    )  # the Slurm wing: a part, which agent, remediator, fleet, steps use


def test_no_module_imports_a_layer_above_it() -> None:
    upward = []
    for name, path in MODULES.items():
        for line, imported in imports(path):
            if layer(imported) > layer(name):
                upward.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {name} ({NAMES[layer(name)]}) imports "
                    f"{imported} ({NAMES[layer(imported)]})"
                )
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_deployable_part_imports_the_lab() -> None:
    assert any(_within(m, DEPLOYABLE) for m in MODULES)
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name} imports {imported}"
        for name, path in MODULES.items()
        if _within(name, DEPLOYABLE)
        for line, imported in imports(path)
        if _within(imported, (LAB,))
    ]
    assert not found, (
        "the deployable parts run from the wheel, which has no lab (its test doubles and simulators); "
        "move what they need out of fleetheal.lab:\n" + "\n".join(found)
    )


def test_the_slurm_wing_needs_nothing_beyond_the_standard_library() -> None:
    """The agent's fast path runs the wing on every GPU node: it may import the standard library and
    fleetheal's bottom layer, nothing a node's Python may lack."""
    found = []
    for name, path in MODULES.items():
        if not _within(name, ("fleetheal.slurm",)):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for imported in names:
                top = imported.split(".")[0]
                ok = top in sys.stdlib_module_names or _within(imported, ("fleetheal.slurm", *BOTTOM_MODULES[1:]))
                if not ok:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name} imports {imported}")
    assert not found, "the Slurm wing imports more than the standard library:\n" + "\n".join(found)
