"""megalite's modules import each other without circles, counting imports inside functions too (a lazy
import that closes a circle is still a circle a reader has to untangle), and no package imports one on a
higher floor than its own (FLOORS)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# megalite's packages, low to high: a module imports from its own package and those below it, never from
# one above. precision (the GEMM recipes) sits below parallel: the tensor-parallel layers call it.
FLOORS = ("errors", "observe", "config", "precision", "parallel", "model", "optim", "data", "checkpoint", "train",
          "planning")


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "megalite")):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the megalite modules it imports anywhere in its text."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def package_of(module: str) -> str | None:
    """The package of ``module`` (``megalite.errors`` is its own); None for megalite's __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(graph: dict[str, set[str]], floors: tuple[str, ...] = FLOORS) -> list[str]:
    """"importer -> imported" for every import of a package on a higher floor than the importer's."""
    floor = {package: level for level, package in enumerate(floors)}
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if floor[package_of(target)] > floor[package_of(module)]:
                found.append(f"{module} -> {target}")
    return found


def test_every_package_has_a_floor():
    packages = {package_of(module) for module in import_graph()} - {None}
    assert packages <= set(FLOORS), f"place {sorted(packages - set(FLOORS))} in FLOORS"


def test_no_module_imports_a_higher_package():
    assert upward_imports(import_graph()) == []


def test_the_check_finds_an_upward_import():
    graph = {"megalite.parallel.pipeline.p2p": {"megalite.train.memory_account", "megalite.observe.memory"},
             "megalite.train.memory_account": {"megalite.observe.memory", "megalite.parallel.collectives"},
             "megalite.observe.memory": set(), "megalite.parallel.collectives": set()}
    assert upward_imports(graph) == ["megalite.parallel.pipeline.p2p -> megalite.train.memory_account"]
