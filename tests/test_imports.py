"""The import graph of `pipeline` and `stages`, read from the source (every import, at module level
or inside a function, and the modules a module imports by name through importlib): no cycles, and `pipeline` (the library) never imports `stages` (the CLI and
its stages), but for `python -m pipeline`, an entry point that nothing imports."""

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`

PACKAGES = ("pipeline", "stages")
ENTRY_POINTS = {"pipeline.__main__"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports: `import a.b`, `from a import b` (b a module or a name in a),
    and, in a module that calls importlib's import_module, every project module it names in a string."""
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    by_name = any(isinstance(node, ast.Attribute) and node.attr == "import_module" or
                  isinstance(node, ast.Name) and node.id in ("import_module", "__import__") for node in ast.walk(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        elif by_name and isinstance(node, ast.Constant) and node.value in known:  # import_module("stages.train")
            names = [node.value]
        else:
            continue
        for name in names:
            while name and name not in known:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, set(found)) - {name} for name, path in found.items()}


def cycle_from(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle through `start`, as the chain of modules, or None."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, chain = stack.pop()
        for nxt in sorted(edges[node]):
            if nxt == start:
                return chain + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, chain + [nxt]))
    return None


def test_the_graph_is_read_from_the_source():
    edges = graph()
    assert "pipeline.config" in edges["stages.train"] and "pipeline.tracking.runs" in edges["stages.train"]
    assert "pipeline.runtime.warm" in edges["stages.entry"]  # an import inside a function counts
    assert "stages.train" in edges["stages.cli"]  # and a module importlib imports by name


def test_no_import_cycles():
    edges = graph()
    cycles = [chain for name in sorted(edges) if (chain := cycle_from(name, edges))]
    assert not cycles, " -> ".join(cycles[0])


def test_the_library_never_imports_the_cli():
    upward = [(name, target) for name, targets in graph().items() if name.startswith("pipeline")
              and name not in ENTRY_POINTS for target in targets if target.split(".")[0] == "stages"]
    assert not upward, upward


def test_a_cycle_would_be_found():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_from("a", edges) == ["a", "b", "c", "a"] and cycle_from("d", edges) is None


def mlflow_importers() -> set[str]:
    found = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(n.split(".")[0] == "mlflow" for n in names):
                found.add(name)
    return found


def test_only_the_tracking_package_imports_mlflow():
    importers = mlflow_importers()
    assert "pipeline.tracking.runs" in importers  # the walk finds an import inside a function
    assert sorted(name for name in importers if not name.startswith("pipeline.tracking.")) == []


def test_each_tracking_module_holds_one_concern_in_at_most_400_lines():
    sizes = {path.name: len(path.read_text().splitlines()) for path in (ROOT / "pipeline" / "tracking").glob("*.py")}
    assert len(sizes) > 5 and {name: n for name, n in sizes.items() if n > 400} == {}


def test_the_tracking_package_init_imports_no_module_of_its_own():
    """Importing any tracking module runs the package's __init__: were it to import its modules, every
    stage would depend on all of them (tests/test_dvc_deps.py)."""
    edges = graph()
    assert edges["pipeline.tracking"] == set()
