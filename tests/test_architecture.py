"""The layout of the code: which folder may import which, no import cycles, no hidden imports.

The module import graph is read from the source (every ``import`` statement, at any depth) and
checked with networkx: it has no cycle, every edge respects the layers of docs/architecture.md's "Where
the code lives", and no function imports a project module (a function-level import usually
hides a cycle or a module in the wrong folder).
"""
import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes", "autopar.cost": ROOT / "cost"}

IR = {"autopar.meta", "autopar.placement", "autopar.sizes", "autopar.ops", "autopar.trace", "autopar.mesh",
      "autopar.planspec", "autopar.schedule", "autopar.context", "autopar.capture",
      "autopar.functionalize", "autopar.data_dependent"}
FRONT = {"autopar", "autopar.api", "autopar.checkpoint", "autopar.explain", "autopar.testing", "autopar.models", "autopar.demo",
         "autopar.__main__", "autopar.verification", "autopar.zoo", "autopar._frozen", "autopar.tuning",
         "autopar.variants", "autopar.fuzz", "autopar.fuzz_models", "autopar.doctor", "autopar.published_runs",
         "autopar.phases", "autopar.predict_local", "autopar.launch", "autopar.compare", "autopar.holdout", "autopar.measure"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The project modules an import statement in ``module`` reads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    base = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(max(node.level - 1, 0)):
        base = base.rpartition(".")[0]
    target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
    found = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in MODULES:
            found.append(sub)          # from package import submodule
        elif target in MODULES:
            found.append(target)       # from module import name
    return found


def _imports():
    """(importer, imported, at module level?) for every import statement of the project."""
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(module, node):
                    if target != module:
                        yield module, target, id(node) in top


def _layer(module: str) -> str:
    if module in IR:
        return "ir"
    if module in FRONT:
        return "front end"
    if module.startswith("autopar.runtime"):
        return "runtime"
    if module.startswith("autopar.passes"):
        return "passes"
    if module.startswith("autopar.cost.calibration"):
        return "calibration"
    if module.startswith("autopar.cost"):
        return "cost"
    raise AssertionError(f"{module} belongs to no layer: add it to IR or FRONT in this test, or move it")


ALLOWED = {   # docs/architecture.md, "Where the code lives"
    "ir": {"ir"},
    "runtime": {"ir", "runtime"},
    "passes": {"ir", "runtime", "passes"},
    "cost": {"ir", "passes", "cost"},
    "calibration": {"ir", "passes", "cost", "calibration", "front end"},
    "front end": {"ir", "runtime", "passes", "cost", "calibration", "front end"},
}


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_the_import_graph_has_no_cycle():
    g = nx.DiGraph()
    g.add_nodes_from(MODULES)
    g.add_edges_from((a, b) for a, b, _ in _imports())
    assert len(g) > 40 and g.number_of_edges() > 100      # the parser found the code
    if not nx.is_directed_acyclic_graph(g):
        cycle = " -> ".join(a for a, _ in nx.find_cycle(g))
        pytest.fail(f"import cycle: {cycle}")


def test_imports_follow_the_layers():
    bad = [f"{a} ({_layer(a)}) imports {b} ({_layer(b)})" for a, b, _ in _imports()
           if _layer(b) not in ALLOWED[_layer(a)]]
    assert not bad, "\n".join(bad)


def test_no_function_imports_a_project_module():
    hidden = [f"{a} imports {b} inside a function" for a, b, top in _imports() if not top]
    assert not hidden, "\n".join(hidden)


def test_the_layers_are_the_documented_ones():
    """The design document this test cites has the section, and it names every layer."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "## Where the code lives" in text, "docs/architecture.md has no 'Where the code lives' section"
    section = text.split("## Where the code lives", 1)[1].split("\n## ", 1)[0]
    missing = [layer for layer in ALLOWED if layer not in section]
    assert not missing, f"docs/architecture.md's 'Where the code lives' does not describe the layers {missing}"
