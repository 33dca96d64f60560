"""Edited copies of a checkpoint folder: copied, a JSON file or the weights edited, quantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import load_file, save_file


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the folder ``src`` at ``dst``."""
    shutil.copytree(src, dst)
    return dst


def edit_json(folder: Path, name: str, edit: Callable[[dict], None]) -> None:
    """Rewrite ``folder/name`` after ``edit`` changed its parsed JSON in place."""
    data = json.loads((folder / name).read_text(encoding="utf-8"))
    edit(data)
    (folder / name).write_text(json.dumps(data), encoding="utf-8")


def edit_weights(folder: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite ``folder/model.safetensors`` after ``edit`` changed its tensors (a dict) in place."""
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def quantize_checkpoint(src: Path, dst: Path, bits: int = 4, group_size: int = 32) -> Path:
    """An MLX-quantized copy (as mlx-vlm's convert writes one) of the tiny checkpoint."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    copy_checkpoint(src, dst)
    model = load_model(dst)

    def predicate(path, module):
        weight = getattr(module, "weight", None)
        return hasattr(module, "to_quantized") and weight.shape[-1] % group_size == 0 and weight.size % 64 == 0

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "mlx"})
    edit_json(dst, "config.json", lambda c: c.__setitem__("quantization", {"group_size": group_size, "bits": bits}))
    return dst
