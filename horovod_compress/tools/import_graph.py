"""The package's import graph in numbers: files, folder boxes, arrows, cycles, function-level imports.

``python -m horovod_compress.tools.import_graph`` prints what
``docs/architecture.md`` reports (it needs grimp, which import-linter, a test
dependency, installs). The layer rule itself is checked by
import-linter (``lint-imports``, contracts in ``pyproject.toml``); this module
only counts. The graph is grimp's (the library import-linter is built on):
one node per file, an arrow per module that imports another, imports inside
functions included and imports under ``if TYPE_CHECKING:`` left out (they never
run). A *box* is a top-level folder or loose module (``tools/`` counted as one);
a *file cycle* is a strongly connected component of more than one file
(SciPy's ``connected_components(connection="strong")``).

A *function-level import* is an import statement of one of the package's own
modules inside a function body (counted with :mod:`ast`). Each gets a reason
from what a top-level import would pull in (:func:`heavy_dependencies`: the
modules it imports at its top, transitively): an optional heavy dependency
(torch, TensorFlow, Keras, Horovod, CuPy, Numba's CUDA target, matplotlib,
tqdm, scikit-learn), mpi4py (importing it starts MPI, and the package promises
that importing it does not), the lazy command line (everything in ``tools/``:
``hvdc --help`` imports only the command table), or none of these.
"""
from __future__ import annotations

import argparse
import ast
import functools
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grimp
import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

PACKAGE = "horovod_compress"
ROOT = Path(__file__).resolve().parents[1]
#: Top-level packages whose import is optional and heavy: a function-level import that reaches
#: one of them keeps ``import horovod_compress`` (and the core) free of it.
HEAVY = {"torch": "torch", "tensorflow": "TensorFlow", "keras": "Keras", "horovod": "Horovod",
         "cupy": "CuPy", "numba.cuda": "Numba's CUDA target", "matplotlib": "matplotlib",
         "tqdm": "tqdm", "sklearn": "scikit-learn", "mpi4py": "mpi4py (starts MPI)"}


def build_graph() -> grimp.ImportGraph:
    """grimp's graph of the package (files only; type-checking imports left out)."""
    return grimp.build_graph(PACKAGE, include_external_packages=False, cache_dir=None,
                             exclude_type_checking_imports=True)


def arrows(graph: grimp.ImportGraph) -> set[tuple[str, str]]:
    """Every (importer, imported) pair of the package's own modules."""
    return {(m, i) for m in graph.modules for i in graph.find_modules_directly_imported_by(m)}


def box(module: str) -> str:
    """The folder (or loose module) a module is drawn in: ``horovod_compress.<first part>``."""
    return ".".join(module.split(".")[:2])


def file_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import cycles between files: strongly connected components of more than one module."""
    modules = sorted(graph.modules)
    index = {m: i for i, m in enumerate(modules)}
    pairs = np.array([(index[a], index[b]) for a, b in arrows(graph)] or np.zeros((0, 2)), dtype=int)
    adjacency = csr_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])),
                           shape=(len(modules), len(modules)))
    _, labels = connected_components(adjacency, directed=True, connection="strong")
    members: dict[int, list[str]] = {}
    for m, label in zip(modules, labels):
        members.setdefault(int(label), []).append(m)
    return sorted(group for group in members.values() if len(group) > 1)


@dataclass(frozen=True)
class FunctionImport:
    """One import of the package's own modules inside a function body."""
    path: str        # relative to the repository root
    line: int
    target: str      # the imported module (absolute)
    reason: str      # why it is not at the top (see the module docstring)


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The modules ``node`` imports, absolute (``from . import a, b`` names submodules ``a``, ``b``)."""
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    if node.module is None:      # ``from . import a``: ``a`` is a submodule (or a name of ``base``)
        return [f"{base}.{a.name}" for a in node.names]
    return [base]


def _sources() -> Iterator[tuple[Path, str, ast.Module]]:
    for path in sorted((ROOT).rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path, _module_of(path), ast.parse(path.read_text(), str(path))


def _top_level_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Modules imported at module level (not inside functions or classes' methods)."""
    out: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.update(_absolute(node, module, is_package))
            if node.level == 0:   # ``from numba import cuda`` imports numba.cuda
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        else:
            stack.extend(ast.iter_child_nodes(node))
    return out


@functools.cache
def _top_level_graph() -> dict[str, set[str]]:
    return {module: _top_level_imports(tree, module, path.name == "__init__.py")
            for path, module, tree in _sources()}


def heavy_dependencies(module: str) -> set[str]:
    """The :data:`HEAVY` packages that importing ``module`` imports (its top-level imports,
    transitively through the package's own modules and their packages' ``__init__``)."""
    graph = _top_level_graph()
    seen, todo, found = set(), [module], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for dep in graph.get(m, ()):
            for heavy in HEAVY:
                if dep == heavy or dep.startswith(heavy + "."):
                    found.add(heavy)
            if dep.startswith(PACKAGE):   # the module and the packages above it (their __init__ run)
                parts = dep.split(".")
                todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found


def function_level_imports() -> list[FunctionImport]:
    """Every import of the package's own modules inside a function, with its reason."""
    out = []
    for path, module, tree in _sources():
        is_package = path.name == "__init__.py"
        seen: set[int] = set()
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if id(node) in seen or not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                seen.add(id(node))
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names if a.name.startswith(PACKAGE)]
                else:
                    targets = [t for t in _absolute(node, module, is_package) if t.startswith(PACKAGE)]
                for target in targets:
                    reason = ("lazy package attribute (PEP 562 __getattr__): importing the package "
                              "stays light" if fn.name == "__getattr__" and fn in tree.body
                              else _reason(module, target, _lazy_names(node, target)))
                    out.append(FunctionImport(str(path.relative_to(ROOT.parent)), node.lineno, target,
                                              reason))
    return out


def _lazy_names(node: ast.AST, target: str) -> list[str]:
    """The modules a package's PEP 562 ``__getattr__`` loads for the names ``node`` takes from it
    (``from ..mpi_collectives import Communicator`` imports mpi4py through it)."""
    if not isinstance(node, ast.ImportFrom) or node.module is None:
        return []
    init = ROOT.parent.joinpath(*target.split("."), "__init__.py")
    if not init.exists():
        return []
    tree = ast.parse(init.read_text())
    bound = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}
    bound |= {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}
    bound |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    getattr_fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef)
                       and n.name == "__getattr__"), None)
    if getattr_fn is None or all(a.name in bound for a in node.names):
        return []
    return [t for n in ast.walk(getattr_fn) if isinstance(n, ast.ImportFrom)
            for t in _absolute(n, target, True)]


def _reason(importer: str, target: str, lazy: list[str] = ()) -> str:
    parts = target.split(".")
    # the target and the packages above it: importing a submodule runs their __init__ first
    heavy = set().union(*(heavy_dependencies(".".join(parts[:i])) for i in range(2, len(parts) + 1)),
                        *(heavy_dependencies(m) for m in lazy))
    framework = sorted(h for h in heavy if h != "mpi4py")
    if framework:
        return "optional heavy dependency: " + ", ".join(HEAVY[h] for h in framework)
    if "mpi4py" in heavy:
        return "starts MPI (mpi4py): importing the package must not"
    if importer.startswith(f"{PACKAGE}.tools"):
        return "lazy command line (tools/)"
    return "none (could move to the top)"


def contract_layers() -> list[list[str]]:
    """The ``layers`` contract's levels, bottom first (``pyproject.toml``), each a list of siblings."""
    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    return [[f"{PACKAGE}.{name.strip()}" for name in level.replace(":", "|").split("|")]
            for level in reversed(layers)]


def level_of(module: str, layers: list[list[str]]) -> int | None:
    """The level (0 = bottom) of the layer ``module`` belongs to; ``None`` for the package's own
    ``__init__`` (the facade, above everything)."""
    for i, level in enumerate(layers):
        if any(module == top or module.startswith(top + ".") for top in level):
            return i
    return None


def upward_arrows(graph: grimp.ImportGraph, level: Callable[[str], int | None]) -> list[tuple[str, str]]:
    """Imports from a lower level to a higher one (the package's facade ``__init__`` left out)."""
    out = []
    for a, b in sorted(arrows(graph)):
        la, lb = level(a), level(b)
        if la is not None and lb is not None and lb > la:
            out.append((a, b))
    return out


def summary() -> dict[str, object]:
    """The numbers ``docs/architecture.md`` reports."""
    graph = build_graph()
    layers = contract_layers()
    edges = arrows(graph)
    boxes = {box(m) for m in graph.modules if m != PACKAGE}
    box_arrows = {(box(a), box(b)) for a, b in edges
                  if PACKAGE not in (a, b) and box(a) != box(b)}
    imports = function_level_imports()
    return {"files": len(graph.modules), "boxes": len(boxes), "box_arrows": len(box_arrows),
            "file_arrows": len(edges), "file_cycles": file_cycles(graph),
            "upward_arrows": upward_arrows(graph, lambda m: level_of(m, layers)),
            "function_level_imports": len(imports),
            "by_reason": dict(Counter(i.reason for i in imports).most_common())}


def main(argv: list[str] | None = None) -> None:
    """Print :func:`summary` (and, with ``--list``, every function-level import with its reason)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list every function-level import")
    args = parser.parse_args(argv)
    numbers = summary()
    for key, value in numbers.items():
        print(f"{key}: {value}")
    if args.list:
        for i in function_level_imports():
            print(f"{i.path}:{i.line}: {i.target}  [{i.reason}]")


if __name__ == "__main__":
    main()
