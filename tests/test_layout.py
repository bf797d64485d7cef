"""One home per concern, read from the imports: the guards decide (they import no runtime, patches,
kernels, frames or report), the kernels stand alone, and no two parts of torchfix import each other."""

from __future__ import annotations

import ast
import pathlib

import torchfix

ROOT = pathlib.Path(torchfix.__file__).parent


def _module(path: pathlib.Path) -> str:
    parts = ["torchfix", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every torchfix module -> the torchfix modules it imports (function-level imports included)."""
    found: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        module = _module(path)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                target = ".".join([*base, node.module] if node.module else base) if node.level else node.module or ""
                deps |= {target, *(f"{target}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        found[module] = {d for d in deps if d.startswith("torchfix")}
    modules = set(found)

    def resolve(name: str) -> str | None:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    return {m: {r for d in deps if (r := resolve(d)) is not None and r != m} for m, deps in found.items()}


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else "torchfix"


def _parts() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m, deps in _imports().items():
        graph.setdefault(_part(m), set()).update(_part(d) for d in deps if _part(d) not in (_part(m), "torchfix"))
    return graph


def test_the_guards_decide_and_import_nothing_that_acts():
    allowed = {"_text", "devices", "errors", "config"}
    assert _parts()["guards"] <= allowed, _parts()["guards"] - allowed


def test_the_kernels_import_nothing_from_guards_runtime_or_patches():
    assert not _parts()["kernels"] & {"guards", "runtime", "patches", "pipeline", "deepcache"}


def test_no_two_parts_import_each_other():
    graph = _parts()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for n in graph.get(todo.pop(), ()):
                if n == goal:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert not cycles, cycles
