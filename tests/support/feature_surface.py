"""Checklist item 12: what the installed mlx-vlm offers a user, and which names docs/features.md lists.

A pin bump that adds a generation keyword, a server flag or route, or a ``python -m mlx_vlm.X``
entry point fails here until docs/features.md names it, so someone decides whether it needs a
row (and a test) for this model.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from typing import Dict, List, Set

FEATURES_DOC = Path(__file__).resolve().parents[2] / "docs" / "features.md"
# The callables whose keywords a user passes; generate and stream_generate hand theirs on to
# generate_step through **kwargs, so its parameters are the generation options.
ENTRY_CALLABLES = (
    ("mlx_vlm", "generate"),
    ("mlx_vlm", "stream_generate"),
    ("mlx_vlm", "batch_generate"),
    ("mlx_vlm.generate", "generate_step"),
)
_FLAG = re.compile(r'add_argument\(\s*"(--[a-z0-9][a-z0-9-]*)"')
_ROUTE = re.compile(r'\b(?:app|router)\.(?:get|post|put|patch|delete|api_route)\(\s*"(/[^"]*)"')
_CODE = re.compile(r"`([^`\n]+)`")


def _keywords(module: str, name: str) -> List[str]:
    try:
        obj = getattr(importlib.import_module(module), name)
        params = inspect.signature(obj).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def feature_surface() -> Dict[str, List[str]]:
    """What the installed mlx-vlm offers a user: keyword arguments of its generation entry
    points, the server's command-line flags and HTTP routes, and its ``python -m`` modules."""
    import mlx_vlm

    root = Path(mlx_vlm.__file__).resolve().parent
    keywords: Set[str] = set()
    for module, name in ENTRY_CALLABLES:
        keywords.update(_keywords(module, name))
    server_files = [root / "server.py"] if (root / "server.py").is_file() else sorted((root / "server").glob("*.py"))
    server = "".join(p.read_text(encoding="utf-8") for p in server_files)
    modules = []
    for info in pkgutil.iter_modules([str(root)]):
        path = root / f"{info.name}.py"
        runnable = (root / info.name / "__main__.py").is_file() or (
            path.is_file() and "__main__" in path.read_text(encoding="utf-8")
        )
        if runnable and info.name != "__main__":
            modules.append(f"mlx_vlm.{info.name}")
    return {
        "keyword": sorted(keywords),
        "server flag": sorted(set(_FLAG.findall(server))),
        "route": sorted(set(_ROUTE.findall(server))),
        "module": sorted(modules),
    }


def listed_names(doc: str) -> Set[str]:
    """Every word inside backticks in ``doc`` (`--kv-bits 8` lists `--kv-bits`)."""
    names: Set[str] = set()
    for code in _CODE.findall(doc):
        for word in code.split():
            names.add(word.strip(",;:()="))
            names.add(word.split("=", 1)[0])
    return names


def unlisted(surface: Dict[str, List[str]], doc: str) -> Dict[str, List[str]]:
    """The names of ``surface`` that ``doc`` does not list, per kind (kinds with none left out)."""
    listed = listed_names(doc)
    missing = {kind: [n for n in names if n not in listed] for kind, names in surface.items()}
    return {kind: names for kind, names in missing.items() if names}
