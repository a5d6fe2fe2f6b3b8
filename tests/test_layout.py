"""The package's import graph: the layers of docs/ARCHITECTURE.md, top to bottom, and no import circle anywhere.

Every `import` statement counts, including those inside functions (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "paraspec"

# a module may import its own layer and the layers below it, never one above (the most specific name wins)
LAYERS = {
    "paraspec.cli": 7,
    "paraspec.server": 6,
    "paraspec.bench": 6,
    "paraspec.study": 6,
    "paraspec.sim": 6,
    "paraspec.engine": 5,
    "paraspec.config": 5,
    "paraspec.prompts": 5,
    "paraspec.text_stream": 5,
    "paraspec.gate": 5,
    "paraspec.streams": 5,
    "paraspec.scheduler": 5,
    "paraspec.placement": 5,
    "paraspec.request_checks": 5,
    "paraspec.strategies": 4,
    "paraspec.drafters": 3,
    "paraspec.request_state": 2,
    "paraspec.errors": 2,
    "paraspec.verify": 2,
    "paraspec.sampling": 2,
    "paraspec.structured": 2,
    "paraspec.stats": 2,
    "paraspec.runtime": 1,
    "paraspec.trace": 1,
    "paraspec.models": 0,
    "paraspec.sim.costs": 0,  # the simulated models' latencies: a leaf the simulators share
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paraspec"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    graph[name].add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name.startswith("paraspec")}
    return graph


def layer(module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    assert [m for m in modules() if m != "paraspec" and m != "paraspec.__main__" and layer(m) is None] == []


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_no_upward_import():
    upward = [
        f"{m} -> {d}"
        for m, deps in import_graph().items()
        for d in deps
        if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)
    ]
    assert upward == []


def test_the_checks_can_fail():
    """The graph and the checks see what they claim to: a made-up circle and an upward import are caught."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "paraspec.models.cache" in graph["paraspec.models.loader"]  # a module-level import
    assert "paraspec.models.llamacpp.model" in graph["paraspec.models.loader"]  # one inside a function
    assert layer("paraspec.sim.costs") == 0 and layer("paraspec.sim.events") == 6


# models/ by backend: the native decoder and llama.cpp each in a package of their own; beside them only what every
# backend shares (the protocol, the cache folder, loading, GGUF conversion, the CPU's flags, a loan of cores, HF and
# simulated models)
MODELS_TOP = {"__init__", "base", "cache", "cpu_features", "gguf", "hf", "loader", "simulated", "threads"}
MODELS_PACKAGES = {
    "native": {"__init__", "decoder", "sequences", "padded", "layer_parallel", "kernels", "shapes"},
    "llamacpp": {"__init__", "model", "child", "child_tasks", "widen"},
}


def test_models_are_split_by_backend():
    models = PACKAGE / "models"
    assert {p.stem for p in models.glob("*.py")} == MODELS_TOP
    assert {p.name for p in models.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(MODELS_PACKAGES)
    for name, expected in MODELS_PACKAGES.items():
        assert {p.stem for p in (models / name).glob("*.py")} == expected, name


def test_tooling_for_lent_gpus_is_not_in_the_library():
    """`make gpu-check` is a benchmark (benchmarks/gpu_check.py): nothing in the package imports or holds it."""
    assert not list(PACKAGE.rglob("gpu_check*.py"))
    assert (PACKAGE.parent / "benchmarks" / "gpu_check.py").exists()
    assert not [name for name, path in modules().items() if "benchmarks" in imported_roots(path)]


def imported_roots(path: Path) -> set[str]:
    """The top-level names a module imports (`benchmarks` for `from benchmarks.gpu_check import ...`)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
    return roots


def test_imported_roots_sees_what_a_module_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os.path\ndef f():\n    from benchmarks.gpu_check import main\n")
    assert imported_roots(module) == {"os", "benchmarks"}


MACHINE_NAMES = re.compile(r"Zen ?[345]|Xeon|H100|H200|EPYC")


def test_the_package_names_no_machine_a_figure_was_measured_on():
    """A measured figure belongs in docs/ (BENCHMARKS.md, results/); the code says the rule it follows and the
    benchmark or test that shows it."""
    assert MACHINE_NAMES.search("1.5x on an H100") and MACHINE_NAMES.search("on a Zen 5")
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if MACHINE_NAMES.search(line)
    ]
    assert not hits, "\n".join(hits)


ROOT = PACKAGE.parent


def test_readme_and_docs_stay_short():
    """README <= 150 lines; each doc <= 300 (dated runs live in docs/results/, which has no limit)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    long_docs = {p.name: n for p in (ROOT / "docs").glob("*.md") if (n := len(p.read_text().splitlines())) > 300}
    assert long_docs == {}


def test_doc_links_resolve():
    """Every relative markdown link in the README and docs/ names a file that exists."""
    broken, checked = [], 0
    for doc in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                checked += 1
                if not (doc.parent / target).exists():
                    broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == [] and checked > 50


def test_the_module_map_lists_every_module_once():
    """docs/modules.md has one row per module of the package, and names no module that is gone."""
    listed = re.findall(r"^\| `(paraspec/[^`]+\.py)` \|", (ROOT / "docs" / "modules.md").read_text(), re.MULTILINE)
    modules_here = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py"))
    assert sorted(listed) == modules_here
