"""Item 5's probe: what ``MODEL_CONFIG`` says of cohere_compass in a fresh interpreter.

Run as ``python probe_model_config.py [--vendored]`` (never ``-m``: importing the package would
import compass_compat and spoil the pristine upstream view). ``--vendored`` applies the shim
first, vendored. Prints one line ``PROBE-JSON {...}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict


def probe(vendored: bool) -> Dict[str, Any]:
    """MODEL_CONFIG's cohere_compass entry, its size, and whether compass_compat was imported."""
    if vendored:
        import compass_compat

        compass_compat.apply_patch("vendored")
    import mlx_vlm.prompt_utils as prompt_utils

    value = prompt_utils.MODEL_CONFIG.get("cohere_compass")
    return {
        "registered": value is not None,
        "format": None if value is None else str(getattr(value, "name", value)),
        "entries": len(prompt_utils.MODEL_CONFIG),
        "compass_compat_imported": "compass_compat" in sys.modules,
    }


if __name__ == "__main__":
    print("PROBE-JSON " + json.dumps(probe("--vendored" in sys.argv[1:])))
