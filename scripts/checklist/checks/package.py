"""Items 1 and 7: the package is there, and every name the vendored code imports exists at this pin."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Tuple

import numpy as np

from ..harness import Context, max_abs
from ..report import FAIL, PASS, UPSTREAM, Item, ItemResult, error_text, fmt
from ..target import PACKAGE
from .base import result


def check_ships(ctx: Context, item: Item) -> ItemResult:
    """Item 1: the implementation under test provides ``mlx_vlm.models.cohere_compass``."""
    if not ctx.target.available:
        return result(ctx, item, FAIL, ctx.target.why_unavailable)
    where = "mlx-vlm's own" if ctx.target.kind == UPSTREAM else "the vendored (forced)"
    return result(ctx, item, PASS, f"mlx-vlm {ctx.target.mlx_vlm_version}: {where} package {ctx.target.package_dir}")


def _vendored_sources() -> List[Tuple[str, Path]]:
    from compass_compat.vendor import vendor_root

    root = vendor_root()
    out = []
    for path in sorted((root / "mlx_vlm").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def external_imports() -> List[Tuple[str, str, List[str]]]:
    """(importing module, imported module, names) for every import of mlx_lm / mlx_vlm /
    transformers in the vendored tree, relative imports resolved; the package's own modules skipped."""
    found = []
    for module_name, path in _vendored_sources():
        is_package = path.name == "__init__.py"
        package = module_name if is_package else module_name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    found.append((module_name, alias.name, []))
                continue
            else:
                continue
            found.append((module_name, target, names))
    keep = []
    for importer, target, names in found:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            continue  # the vendored package itself: covered by importing it
        if target.partition(".")[0] in ("mlx_lm", "mlx_vlm", "transformers"):
            keep.append((importer, target, names))
    return keep


def _import_side_by_side() -> ModuleType:
    """The vendored package, imported whole: the live one in vendored mode, else beside upstream's
    under its own name (the one copy compass_compat.vendor loads)."""
    from compass_compat.vendor import vendored_module

    return vendored_module()


def _rope_reference_error() -> float:
    """max |initialize_rope(...)(x) - rotate-half RoPE computed in numpy| as the vendored code calls it."""
    import mlx.core as mx
    from mlx_lm.models.rope_utils import initialize_rope

    head_dim, theta, offset = 16, 50000.0, 5
    rope = initialize_rope(head_dim, base=theta, traditional=False)
    x = np.random.default_rng(0).standard_normal((1, 2, 7, head_dim)).astype(np.float32)
    got = np.array(rope(mx.array(x), offset=offset))
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(offset, offset + 7, dtype=np.float64)[:, None] * inv
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    half = head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return max_abs(got, x * cos + rotated * sin)


def check_vendored_imports(ctx: Context, item: Item) -> ItemResult:
    """Item 7: every mlx-lm / mlx-vlm / transformers name the vendored code imports resolves here,
    initialize_rope computes rotate-half RoPE, and the package imports side by side."""
    resolved, missing = [], []
    for importer, target, names in external_imports():
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # the error is the evidence
            missing.append(f"{target} (imported by {importer}): {error_text(exc, 120)}")
            continue
        for name in names:
            if not hasattr(module, name) and importlib.util.find_spec(f"{target}.{name}") is None:
                missing.append(f"{target}.{name} (imported by {importer})")
            else:
                resolved.append(f"{target}.{name}")
        if not names:
            resolved.append(target)
    details: Dict[str, Any] = {"resolved": sorted(set(resolved)), "missing": missing}
    rope = "initialize_rope: not checked"
    try:
        err = _rope_reference_error()
        details["initialize_rope_max_abs"] = err
        rope = f"initialize_rope = numpy rotate-half RoPE to {fmt(err)}"
        if not err <= 1e-5:
            missing.append(f"mlx_lm initialize_rope(non-traditional) is not rotate-half RoPE (max|d| {fmt(err)})")
    except Exception as exc:  # the error is the evidence
        missing.append(f"initialize_rope: {error_text(exc, 160)}")
    try:
        module = _import_side_by_side()
        side = f"vendored package imports as {module.__name__}"
    except Exception as exc:  # the error is the evidence
        missing.append(f"importing the vendored package: {error_text(exc, 200)}")
        side = ""
    rotary = [r for r in sorted(set(resolved)) if "rope" in r]
    evidence = (
        f"{len(set(resolved))} names resolve ({', '.join(rotary) or 'no rotary helper imported'}; {rope}); {side}"
    )
    if missing:
        return result(ctx, item, FAIL, "missing: " + "; ".join(missing), details)
    return result(ctx, item, PASS, evidence, details)
