"""The import directions, kept: scripts/ imports of tests/ only its support code (tests.support),
and nothing shipped (compass_compat/, compass_data/, vendor/) imports tests/ or scripts/ (the wheel
carries neither).

    python3 scripts/check/imports.py [ROOT]      (scripts/check/lint.sh runs it; stdlib only)

Prints each offending import as FILE:LINE and exits 1; exit 0 when every import keeps its direction.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

# Folder -> the top-level packages its files must not import.
FORBIDDEN = {
    "scripts": ("tests",),
    "compass_compat": ("tests", "scripts"),
    "compass_data": ("tests", "scripts"),
    "vendor": ("tests", "scripts"),
}
# Folder -> the modules under a forbidden package it may import after all: the recorders and
# benchmarks share the suite's support code rather than keep a copy.
ALLOWED = {"scripts": ("tests.support",)}


def imported(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, dotted module) of every absolute import in ``tree``; ``from a import b`` gives ``a.b``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(root: Path) -> List[str]:
    found = []
    for folder, banned in FORBIDDEN.items():
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for line, module in imported(tree):
                package = module.split(".")[0]
                if package in banned and not any(within(module, ok) for ok in ALLOWED.get(folder, ())):
                    found.append(
                        f"{path.relative_to(root)}:{line}: imports {package} ({folder}/ never imports {', '.join(banned)})"
                    )
    return found


def main(argv: List[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[2]
    found = violations(root)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
