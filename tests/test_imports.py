"""megalite's import graph, read from the source with ``ast`` (nothing is imported).

Two rules of docs/architecture.md are checked on every ``import`` statement,
including those inside functions and ``TYPE_CHECKING`` blocks, but not those under
``if __name__ == "__main__":`` (that block runs only when the file is the program,
``python -m megalite.topology``, as module ``__main__``, not as part of the package): no two modules
import each other, directly or through others, and each package imports only
the packages listed before it in the architecture table (packages sharing a
row are one layer).
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megalite"


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every module under megalite/ (a package is its __init__)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_main_guard(node: ast.stmt) -> bool:
    """Whether ``node`` is a top-level ``if __name__ == "__main__":`` block."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def imported_names(name: str, path: pathlib.Path) -> list[tuple[str, str | None]]:
    """``(module, attribute)`` of every import in ``name`` (attribute None for ``import module``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = []
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [node for node in tree.body if not _is_main_guard(node)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.extend((base, alias.name) for alias in node.names)
    return names


def imported_modules(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The megalite modules that ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    targets = set()
    for module, attribute in imported_names(name, path):
        full = f"{module}.{attribute}"
        targets.add(full if attribute is not None and full in known else module)
    found = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
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


def package_layers() -> dict[str, int]:
    """Module or package prefix -> its row in the architecture table (0 = lowest)."""
    layers = {}
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `megalite")]
    for row, line in enumerate(rows):
        first_cell = line.split("|")[1]
        for path in re.findall(r"`(megalite/[^`]*)`", first_cell):
            layers[path.removesuffix("/").removesuffix(".py").replace("/", ".")] = row
    return layers


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    while module and module not in layers:
        module = module.rpartition(".")[0]
    return layers.get(module)


def test_cycle_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_from_imports_resolve(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from . import b\nfrom .c import x\nimport megalite.d.e\nfrom megalite.d import f\n")
    known = {"megalite.p.a", "megalite.p.b", "megalite.p.c", "megalite.d", "megalite.d.e"}
    assert imported_modules("megalite.p.a", source, known) == {
        "megalite.p.b", "megalite.p.c", "megalite.d", "megalite.d.e"}


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_every_megalite_import_names_a_module():
    """A module renamed without updating an importer shows up here, not only when that import runs."""
    files = module_files()
    missing = sorted(f"{name}: {module}" for name, path in files.items()
                     for module, _ in imported_names(name, path)
                     if module.split(".")[0] == "megalite" and module not in files)
    assert missing == []


def test_every_package_is_in_the_architecture_table():
    layers = package_layers()
    assert "megalite.topology" in layers and "megalite.rlhf" in layers
    unplaced = [m for m in import_graph() if m != "megalite" and layer_of(m, layers) is None]
    assert unplaced == []


def test_packages_import_only_lower_layers():
    layers = package_layers()
    upward = []
    for module, targets in sorted(import_graph().items()):
        own = layer_of(module, layers)
        for target in sorted(targets):
            other = layer_of(target, layers)
            if own is not None and other is not None and other > own:
                upward.append(f"{module} -> {target}")
    assert upward == []
