"""The folder layout holds: no module over 500 lines, and no import cycle, neither between
modules nor between our top-level packages (the layering itself is import-linter's, in
``pyproject.toml``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["aio", "kvkeys", "prompt", "index", "router", "replica", "bench", "kvroute"]
MAX_LINES = 500
OVER_LIMIT_ALLOWED: set[str] = set()


def cycles(nodes: Iterable[str], edges: Callable[[str], Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["d"]}
    assert cycles(graph, lambda n: graph[n]) == [["a", "b", "c"]]
    assert cycles({"x": []}, lambda n: []) == []


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    assert cycles(graph.modules, graph.find_modules_directly_imported_by) == []

    def package_edges(package: str) -> list[str]:
        return [
            other for other in PACKAGES
            if other != package
            and graph.direct_import_exists(importer=package, imported=other, as_packages=True)
        ]  # fmt: skip

    assert cycles(PACKAGES, package_edges) == []


def test_no_module_over_500_lines() -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    assert len(sizes) > 50
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert set(over) <= OVER_LIMIT_ALLOWED, over


# The request's path: parse, decide (render, key, look up, score), relay, receipt.
REQUEST_PATH = [
    "router/proxy.py", "router/relay.py", "router/fast_metrics.py", "router/request.py",
    "router/usage.py", "router/load.py",
    "router/scoring.py", "router/affinity.py", "router/provisional.py", "router/horizon.py",
    "router/session_policy.py", "router/load_policies.py", "router/kv_services.py",
    "router/kv_policy.py", "router/kv_choice.py", "router/replica_view.py",
    "router/session_tracker.py", "router/session_table.py", "router/move_cost.py",
    "router/residency.py", "router/prefix_breaks.py", "router/receipts.py",
    "router/tenancy.py", "router/tenant_limits.py", "router/validate.py",
    "router/prompt_bounds.py",
    "index/memory.py", "index/redis_store.py", "index/masks.py", "kvkeys/keys.py",
    *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "prompt").glob("*.py"))),
]
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_ALLOWED: set[str] = set()


def _functions(path: Path) -> dict[str, int]:
    """``Class.method`` or ``function`` -> its length in lines, for one module."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert child.end_lineno is not None
                out[f"{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return out


def test_no_request_path_function_over_60_lines() -> None:
    long = {
        f"{name}::{function}": lines
        for name in REQUEST_PATH
        for function, lines in _functions(ROOT / name).items()
        if lines > MAX_FUNCTION_LINES
    }
    assert set(long) <= LONG_FUNCTIONS_ALLOWED, long


def test_cli_import_stays_light() -> None:
    """``kvroute --help`` imports the CLI only: no server, index or tokenizer library."""
    heavy = ("tokenizers", "jinja2", "zmq", "redis", "aiohttp", "uvicorn", "starlette",
             "prometheus_client", "numpy", "transformers")  # fmt: skip
    code = f"import kvroute.cli, sys; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)  # fmt: skip
    assert out.stdout.strip() == "[]"
