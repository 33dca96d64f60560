"""Item 6's probe: with torch hidden, which processor ``mlx_vlm.load`` and ``AutoProcessor`` build.

Run as ``python probe_processor.py [--vendored] FOLDER IMAGE PROMPT`` (never ``-m``: importing the
package would import compass_compat before torch is hidden, and in upstream mode at all).
``--vendored`` applies the shim first, vendored. Prints one line ``PROBE-JSON {...}``.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
from typing import Any, Dict, Iterator, List, Optional

_HIDDEN = {"torch", "torchvision", "torchaudio"}


class _WithoutTorch(importlib.machinery.PathFinder):
    """The path finder, except that torch and friends are not installed."""

    @classmethod
    def find_spec(cls, name: str, path: Optional[Any] = None, target: Optional[Any] = None) -> Any:
        if name.partition(".")[0] in _HIDDEN:
            return None  # not installed: import raises ModuleNotFoundError, find_spec gives None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for dist in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if (dist.metadata["Name"] or "").lower() not in _HIDDEN:
                yield dist


def hide_torch() -> None:
    """From now on this interpreter behaves as if torch were not installed."""
    sys.meta_path[:] = [_WithoutTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path]


def probe(folder: str, image: str, prompt: str) -> Dict[str, Any]:
    """The processors built for ``folder`` and the pixel values of ``image``, or the error."""
    out: Dict[str, Any] = {}
    try:
        from transformers import AutoProcessor

        bare = AutoProcessor.from_pretrained(folder)
        out["bare_auto_processor"] = type(bare).__module__ + "." + type(bare).__name__
    except Exception as exc:  # recorded: informational in the report
        out["bare_auto_processor"] = f"{type(exc).__name__}: {exc}"[:200]
    try:
        import mlx_vlm.models.cohere_compass as package  # what mlx_vlm.load imports first
        from mlx_vlm import load

        model, processor = load(folder)
        out["load_processor"] = type(processor).__module__ + "." + type(processor).__name__
        out["load_processor_file"] = sys.modules[type(processor).__module__].__file__
        from transformers import AutoProcessor

        auto = AutoProcessor.from_pretrained(folder)
        out["auto_processor"] = type(auto).__module__ + "." + type(auto).__name__
        out["auto_processor_file"] = sys.modules[type(auto).__module__].__file__
        from PIL import Image

        batch = processor(text=prompt, images=[Image.open(image)])
        out["pixel_values_shape"] = list(getattr(batch["pixel_values"], "shape", []))
        out["package_file"] = package.__file__
    except Exception as exc:  # the error is the evidence
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["torch_imported"] = any(m.partition(".")[0] in ("torch", "torchvision") for m in sys.modules)
    out["compass_compat_imported"] = "compass_compat" in sys.modules
    return out


def main(argv: List[str]) -> Dict[str, Any]:
    """Hide torch, apply the shim if ``--vendored``, then probe."""
    hide_torch()
    if argv and argv[0] == "--vendored":
        import compass_compat

        compass_compat.apply_patch("vendored")
        argv = argv[1:]
    folder, image, prompt = argv
    return probe(folder, image, prompt)


if __name__ == "__main__":
    print("PROBE-JSON " + json.dumps(main(sys.argv[1:])))
