"""The shape of the package: titanlite's modules import each other without a circle, read from the
package's own source (every import statement, also those inside functions, so a circle cannot hide
behind a lazy import), and no file is over 500 lines."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "titanlite"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each titanlite module -> the titanlite modules its import statements load. Importing a.b.c
    also runs a and a.b (their __init__): those count too, except the module's own parent packages,
    which are loaded before it anyway, unless it names one itself (`from a import X` inside a.b:
    a must have finished loading by then). A family's plan, loaded by name at run time through
    importlib (ModelFamily.plan), is no import statement and is not counted."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}

    def parents(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:n]) for n in range(1, len(parts))} & modules.keys()

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        named = set()  # the modules an import statement names
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package this module sits in
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
                # `from package import module` names the module; `from module import name` the module
                named |= submodules if len(submodules) == len(node.names) else submodules | {base}
        named &= modules.keys()
        implied = set().union(*map(parents, named)) - parents(name) if named else set()
        graph[name] = (named | implied) - {name}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (the modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_the_circle_finder_finds_a_circle_and_a_parent_package_edge():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = import_graph()
    # preflight's `from titanlite.checkpoint.paths import ...` runs titanlite/checkpoint/__init__.py first.
    assert {"titanlite.checkpoint", "titanlite.checkpoint.paths"} <= graph["titanlite.preflight"]
    # A module's own parent package counts only where it names it: the registry is loading when a
    # family's module imports from titanlite.models, which is a circle.
    assert "titanlite.models" not in graph["titanlite.models.llama3.args"]
    assert "titanlite.models" in graph["titanlite.config.schema"]


def test_titanlite_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 30 and sum(map(len, graph.values())) > 50  # the graph was read at all
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_no_titanlite_file_is_over_500_lines():
    lengths = {str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(lengths) > 30
    assert not {path: n for path, n in lengths.items() if n > 500}
