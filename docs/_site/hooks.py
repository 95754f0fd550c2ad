"""MkDocs hooks of the documentation site (``mkdocs.yml`` names this file).

1. The site's page tree mirrors the repository: ``docs/x.md`` is served at
   ``docs/x/``, ``benchmarks/*.md`` and their plots under ``benchmarks/``,
   ``examples/`` and ``README.md`` (the home page) where they are. Relative
   links written for reading the Markdown on a forge therefore work in the site
   unchanged, and ``mkdocs build --strict`` fails on a link to a file that does
   not exist. The source tree (``horovod_compress/``, ``scripts/``,
   ``tests/``) is not part of the site: pages name source files in code
   spans, not links. A link to a folder (``docs/methods/``) goes to its
   ``index.md`` or ``README.md``.
2. Every public module, class and function of the library must have a
   docstring (its own, or the one of the base-class method it overrides): a
   missing one is logged as a warning, which ``--strict`` turns into an error.
   ``horovod_compress.tools.bench`` (the ``hvdc bench`` commands, documented by
   ``hvdc bench <name> -h`` and by their results pages) is not part of the API
   reference and is not checked.
3. Generated sections: a page may hold a marker comment that is replaced at
   build time -- ``<!-- hvdc:methods-table -->`` (every method's parameters and
   defaults, read from the registry). The alpha-beta model's predictions per
   network are the generated page ``docs/choosing.md``.
"""
from __future__ import annotations

import inspect
import logging
import os
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.hvdc")

ROOT = Path(__file__).resolve().parents[2]
# Top-level folders whose files are site pages (Markdown) or their plots and data.
PAGE_DIRS = ("docs", "benchmarks", "examples")
TOP_FILES = ("README.md",)
SKIP_PARTS = {"__pycache__", "_site", ".ipynb_checkpoints"}
SKIP_SUFFIXES = {".pyc", ".so", ".o"}
# Not part of the API reference (see the module docstring).
UNCHECKED_MODULES = ("horovod_compress.tools.bench",)


# --------------------------------------------------------------------------- files
def _walk(top: Path):
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_PARTS and not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.startswith(".") or path.suffix in SKIP_SUFFIXES:
                continue
            yield path


def on_files(files: Files, config) -> Files:
    """Replace the files found in ``docs_dir`` by the repository-shaped tree."""
    docs_dir = Path(config.docs_dir).resolve()
    kept = [f for f in files if f.abs_src_path is None
            or not Path(f.abs_src_path).resolve().is_relative_to(docs_dir)]
    out = Files(kept)
    urls = config.use_directory_urls
    site = config.site_dir

    def add(path: Path) -> None:
        rel = path.relative_to(ROOT).as_posix()
        out.append(File(rel, src_dir=str(ROOT), dest_dir=site, use_directory_urls=urls))

    for name in TOP_FILES:
        if (ROOT / name).is_file():
            add(ROOT / name)
    for top in PAGE_DIRS:
        for path in _walk(ROOT / top):
            add(path)
    return out


# --------------------------------------------------------------------- docstrings
def _inherited_doc(cls, name: str) -> bool:
    """True when a base class (resolvable or not) defines ``name``: its docstring applies."""
    for base in cls.resolved_bases if hasattr(cls, "resolved_bases") else []:
        member = base.all_members.get(name) if hasattr(base, "all_members") else None
        if member is not None and not member.is_alias and member.docstring:
            return True
        if member is not None and _inherited_doc(base, name):
            return True
    # A base outside the package (keras.callbacks.Callback, ...): its hooks are documented there.
    try:
        resolved = {b.path for b in cls.resolved_bases}
    except Exception:  # noqa: BLE001 -- griffe raises several kinds when a base cannot be loaded
        resolved = set()
    external = [str(b) for b in cls.bases if not str(b).startswith("horovod_compress")
                and str(b) not in resolved and str(b) not in ("object", "Generic", "Protocol")
                and not str(b).startswith(("typing", "Generic[", "Protocol["))]
    return bool(external)


def missing_docstrings(package: str = "horovod_compress") -> list[str]:
    """Dotted paths of public modules, classes and functions without a docstring."""
    import griffe
    pkg = griffe.load(package, search_paths=[str(ROOT)], resolve_aliases=False,
                      allow_inspection=False)
    missing: list[str] = []

    def public(name: str) -> bool:
        return not name.startswith("_")

    def walk(obj) -> None:
        for name, member in obj.members.items():
            if member.is_alias or not public(name):
                continue
            if member.path.startswith(UNCHECKED_MODULES):
                continue
            if member.is_module:
                if not member.docstring:
                    missing.append(member.path)
                walk(member)
            elif member.is_class or member.is_function:
                if not member.docstring and not (obj.is_class and _inherited_doc(obj, name)):
                    missing.append(member.path)
                if member.is_class:
                    walk(member)
    if not pkg.docstring:
        missing.append(pkg.path)
    walk(pkg)
    return missing


def on_pre_build(config) -> None:
    """Warn (an error under ``--strict``) for each public object without a docstring."""
    for path in missing_docstrings():
        log.warning("missing docstring: %s (every public module, class and function needs one)", path)


# ------------------------------------------------------------ generated sections
def _methods_table() -> str:
    from horovod_compress.compressors import registry
    rows = ["| method | what it is | parameters (defaults) |", "|---|---|---|"]
    for name in registry.available():
        cls = registry.method_class(name)
        doc = (inspect.getdoc(cls) or "").strip().splitlines()
        first = doc[0] if doc else ""
        params = [f"`{key}={value!r}`" for key, value in registry.defaults(name).items()]
        rows.append(f"| `{name}` | {first.replace('|', '/')} | {', '.join(params).replace('|', '/')} |")
    return "\n".join(rows)


_DIR_LINK = re.compile(r"\]\((?!https?:|/|#)([^)\s#]*/)(#[^)\s]*)?\)")


def _directory_links(markdown: str, page_src: str) -> str:
    """``[x](docs/methods/)`` -> ``[x](docs/methods/index.md)``: a forge shows a folder's
    README/index, the site needs the page itself (only when that page exists)."""
    here = (ROOT / page_src).parent

    def fix(m: re.Match) -> str:
        folder = (here / m.group(1)).resolve()
        for name in ("index.md", "README.md"):
            if (folder / name).is_file():
                return f"]({m.group(1)}{name}{m.group(2) or ''})"
        return m.group(0)
    return _DIR_LINK.sub(fix, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fill the marker comments described in the module docstring; resolve folder links. Benchmark
    pages (wide tables) give the table-of-contents column to their content."""
    markdown = _directory_links(markdown, page.file.src_uri)
    if page.file.src_uri.startswith("benchmarks/"):
        page.meta.setdefault("hide", ["toc"])
    if "<!-- hvdc:methods-table -->" in markdown:
        markdown = markdown.replace("<!-- hvdc:methods-table -->", _methods_table())
    return markdown
