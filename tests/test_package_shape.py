"""The packages' shape: one order of layers with no import climbing back up, no import circle (every import
counts, at module level, inside functions and under TYPE_CHECKING, read from the source with `ast`, so a
circle fails here before it fails at import time), and no module longer than a newcomer reads in one go."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 460

# art_sglang's layers, bottom to top (docs/architecture.md, "Layers"): each names its parts, a part its
# modules (dotted, under art_sglang; a package stands for every module in it, the longest name wins). A
# module imports its own part and the layers below; parts side by side import neither each other nor up.
HELPERS = (
    "errors",
    "types",
    "process_tree",
    "sglang_env",
    "server_defaults",
    "chat_format",
    "token_bounds",
    "cpu_threads",
    "tiny_model",
    "gather_context",
    "constraints",
    "tool_choice",
    "grammars",
    "trajectories",
    "tracking",
    "gather",
    "backend_protocol",
    "named_tensors",
    "weight_group",
)
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {"helpers": HELPERS},
    {"config": ("config",)},
    {"storage": ("storage",), "cuda_mps": ("cuda_mps",)},
    {"training": ("training",)},
    {"planning": ("planning",)},
    {"serving": ("serving", "serving.sglang_api", "serving.served_names")},
    {"servers": ("serving.servers",), "gateway": ("serving.gateway",)},
    {"adapters": ("serving.adapters",)},
    {"cluster": ("cluster",), "model": ("model",)},
    {"orchestration": ("orchestration",)},
    {"backend": ("backend",)},
    {"face": ("",)},  # art_sglang/__init__.py: the public names
]
# What the reference engine, a program of its own, shares with the client.
REFERENCE_USES = {"helpers", "config", "serving"}


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` (a package is its `__init__.py`)."""
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that importing `name` runs: each one named, and each package on the way
    to it (its `__init__`), except the packages `name` itself sits in (they are imported before it)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    own_packages = {".".join(name.split(".")[:n]) for n in range(1, name.count(".") + 1)}
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            submodules = {f"{source}.{alias.name}" for alias in node.names} & modules
            named.update(submodules)
            if len(submodules) < len(node.names):  # names defined in `source` itself
                named.add(source)
    found = set()
    for target in named:
        parts = target.split(".")
        for n in range(1, len(parts) + 1):
            module = ".".join(parts[:n])
            if module in modules and (module == target or module not in own_packages):
                found.add(module)
    found.discard(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def import_graph(package: Path) -> dict[str, set[str]]:
    files = module_files(package)
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def part_of(module: str) -> tuple[int, str] | None:
    """(layer, part) of an art_sglang module; None where no layer names it."""
    name = module.removeprefix("art_sglang").removeprefix(".")
    found = [
        (len(prefix), layer, part)
        for layer, parts in enumerate(LAYERS)
        for part, prefixes in parts.items()
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".") or (prefix == "" and name == "")
    ]
    return max(found)[1:] if found else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import that climbs to a higher layer or crosses to a part beside its own, in words."""
    wrong = []
    for module, targets in sorted(graph.items()):
        here = part_of(module)
        for target in sorted(targets):
            there = part_of(target)
            if here is None or there is None or here == there or there[0] < here[0]:
                continue
            wrong.append(f"{module} ({here[1]}) imports {target} ({there[1]})")
    return wrong


def test_every_module_has_a_layer() -> None:
    unplaced = [module for module in import_graph(ROOT / "art_sglang") if part_of(module) is None]
    assert not unplaced, f"name these modules' layer in LAYERS (and docs/architecture.md): {unplaced}"


def test_no_import_climbs_back_up() -> None:
    wrong = upward_imports(import_graph(ROOT / "art_sglang"))
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_reference_engine_shares_only_the_bottom_layers() -> None:
    used = set()
    for path in (ROOT / "art_sglang_reference").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("art_sglang.")
            ):
                used.add(node.module)
            elif isinstance(node, ast.ImportFrom) and node.module == "art_sglang":
                used.update(f"art_sglang.{alias.name}" for alias in node.names)
    assert used  # the reference engine was read
    wrong = {module for module in used if (part_of(module) or (0, "?"))[1] not in REFERENCE_USES}
    assert not wrong, f"the reference engine imports {sorted(wrong)}: share only {sorted(REFERENCE_USES)}"


def test_an_import_against_the_layers_is_found() -> None:
    graph = {
        "art_sglang.storage.model_store": {"art_sglang.planning.internal_config"},  # climbs
        "art_sglang.serving.gateway.app": {"art_sglang.serving.servers.group"},  # beside
        "art_sglang.serving.adapters": {"art_sglang.serving.gateway.app", "art_sglang.config"},  # down
        "art_sglang.training.trainer": {"art_sglang.training.loss"},  # its own part
    }
    assert upward_imports(graph) == [
        "art_sglang.serving.gateway.app (gateway) imports art_sglang.serving.servers.group (servers)",
        "art_sglang.storage.model_store (storage) imports art_sglang.planning.internal_config (planning)",
    ]


@pytest.mark.parametrize("package", ["art_sglang", "art_sglang_reference"])
def test_no_import_circle(package: str) -> None:
    graph = import_graph(ROOT / package)
    assert len(graph) > 5  # the package was found
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", ["art_sglang", "art_sglang_reference"])
def test_no_module_over_460_lines(package: str) -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / package).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these modules (at most {MAX_MODULE_LINES} lines): {long}"


def test_a_circle_under_type_checking_or_through_a_package_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    )
    (package / "b.py").write_text("from . import a\n")
    assert find_cycle(import_graph(package)) == ["pkg.a", "pkg.b", "pkg.a"]
    (package / "b.py").write_text("import json\n")
    assert find_cycle(import_graph(package)) is None
    # Importing pkg.sub.c runs pkg/sub/__init__.py, which imports a.
    (package / "sub" / "__init__.py").write_text("from ..a import *\n")
    (package / "sub" / "c.py").write_text("X = 1\n")
    (package / "b.py").write_text("from .sub.c import X\n")
    (package / "a.py").write_text("def f():\n    from pkg.b import X\n")
    assert find_cycle(import_graph(package)) == ["pkg.a", "pkg.b", "pkg.sub", "pkg.a"]
