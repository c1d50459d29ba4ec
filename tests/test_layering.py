"""Dependencies point one way: CLI -> chat/serve/bench -> api -> deploy | engine -> kernels, with the shared pieces
(workspace format, chat templates, engine options) in neutral modules. Every import counts, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lmd"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """lmd module -> the lmd modules it imports (a `from pkg import name` counts pkg.name when that is a module)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("lmd"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmd"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


GRAPH = _imports()


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# (importer prefix, forbidden prefixes): the arrows that must not exist
FORBIDDEN = [
    ("lmd.turbomind", ["lmd.chat", "lmd.serve", "lmd.bench", "lmd.deploy", "lmd.lite", "lmd.eval", "lmd.api",
                       "lmd.engine_options", "lmd.cli", "lmd.demo", "lmd.default_model"]),
    ("lmd.deploy", ["lmd.chat", "lmd.serve", "lmd.bench", "lmd.api", "lmd.engine_options"]),
    ("lmd.workspace_format", ["lmd.turbomind", "lmd.deploy", "lmd.chat", "lmd.serve", "lmd.bench", "lmd.lite"]),
    ("lmd.chat_templates", ["lmd.turbomind", "lmd.deploy", "lmd.chat", "lmd.serve"]),
    ("lmd.bench", ["lmd.chat", "lmd.serve"]),
    ("lmd.serve", ["lmd.chat", "lmd.bench"]),
    ("lmd.chat", ["lmd.serve", "lmd.bench"]),
]


@pytest.mark.parametrize(("importer", "forbidden"), FORBIDDEN, ids=[f[0] for f in FORBIDDEN])
def test_no_upward_imports(importer: str, forbidden: list[str]) -> None:
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if _under(m, importer)
                 for t in targets if any(_under(t, f) for f in forbidden))
    assert not bad, bad


def test_deploy_uses_only_the_kernels_of_the_engine() -> None:
    """deploy and the engine share the workspace format; deploy may use the int4 packing of the kernels (a leaf)."""
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if _under(m, "lmd.deploy")
                 for t in targets if _under(t, "lmd.turbomind") and not _under(t, "lmd.turbomind.kernels"))
    assert not bad, bad


def test_kernels_are_leaves() -> None:
    """A kernel module takes tensors: it imports other kernels, lmd.errors, lmd.cache_dir and lmd's version only."""
    allowed = ("lmd.turbomind.kernels", "lmd.errors", "lmd.cache_dir")
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if _under(m, "lmd.turbomind.kernels")
                 for t in targets if t != "lmd" and not any(_under(t, a) for a in allowed))
    assert not bad, bad


def test_no_import_cycles() -> None:
    """No module reaches itself through imports (package __init__ files that only re-export lazily excluded)."""
    graph = {m: {t for t in ts if not (PACKAGE.parent / (t.replace(".", "/") + "/__init__.py")).is_file()}
             for m, ts in GRAPH.items()}
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, stack + [node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, [" -> ".join(c) for c in cycles[:5]]


def test_the_graph_sees_lazy_imports() -> None:
    """The check would pass vacuously if function-level imports were missed: the pipeline deploys lazily."""
    assert "lmd.deploy.converter" in GRAPH["lmd.api"]
