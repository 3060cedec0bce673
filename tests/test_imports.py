"""The package's imports, read from the source: no module of flashattn/ imports itself back through
another (function-level imports count: they are how circles used to hide), the checker's readers
never import its mistakes, no mistake module imports another, and no module of flashattn/ is over
700 lines."""
import ast
import subprocess
import sys
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "flashattn"

def _modules() -> dict:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set:
    """The flashattn modules ``name`` imports, anywhere in its source. ``from pkg import x`` counts
    as importing ``pkg.x`` when that is a module, else ``pkg``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                if f"{source}.{a.name}" in MODULES:
                    found.add(f"{source}.{a.name}")
                elif source in MODULES:
                    found.add(source)
    return found - {name}


GRAPH = {name: _imports(name) for name in MODULES}


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(frozenset(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert "flashattn.check.engine" in GRAPH["flashattn.check.checkers"]


def test_no_import_circle_in_flashattn():
    circles = [sorted(c) for c in _circles(GRAPH)]
    assert not circles, f"modules that import each other: {circles}"


def test_readers_never_import_mistakes_and_mistakes_never_each_other():
    mistakes = {m for m in MODULES if m.startswith("flashattn.check.mistakes.")}
    for name, deps in GRAPH.items():
        if name in ("flashattn.check", "flashattn.check.mistakes"):
            continue        # the package imports them all, once, to register them
        assert not deps & mistakes, f"{name} imports {sorted(deps & mistakes)}"


def test_no_module_is_over_700_lines():
    long = {name: n for name, path in MODULES.items() for n in [len(path.read_text().splitlines())] if n > 700}
    assert not long, long


def test_the_cuda_selftest_command_still_runs():
    """cuda_appendix no longer imports cuda_selftest (which imports it): its command line runs it."""
    out = subprocess.run([sys.executable, "-m", "flashattn.cuda_appendix", "--help"], capture_output=True,
                         text=True, cwd=PACKAGE.parent, timeout=120)
    assert out.returncode == 0 and "--selftest" in out.stdout, out.stderr
