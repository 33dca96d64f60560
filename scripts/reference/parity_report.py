"""Print measured max differences against the recorded transformers reference.

Run in any pin env (with COMPASS_COMPAT_FORCE_VENDORED=1 on pins that ship
cohere_compass). Also shows the negative controls: a contiguous-section MRoPE
and a sliding window one token too wide must break parity.

    .venvs/mlxvlm-0.3.9/bin/python scripts/reference/parity_report.py
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_vlm
import numpy as np

import compass_compat
from compass_data.tiny import build_tiny_checkpoint
from scripts._lib.parity import chunked_prefill, greedy, prefill, teacher_forced_decode
from scripts._lib.recorded import ReferenceFixtures


def measure(model, ref, name):
    case = ref(name)
    pre = np.abs(np.array(prefill(model, case)) - case["prefill_logits"]).max()
    dec = np.abs(teacher_forced_decode(model, case) - case["greedy_logits"]).max()
    same = greedy(model, case, 32) == case["greedy_ids"].tolist()
    return pre, dec, same


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def main() -> None:
    from mlx_vlm.utils import load_model  # imported after the patch, which wraps it

    info = compass_compat.implementation_info()
    print(f"mlx-vlm {mlx_vlm.__version__}; live implementation: {info}")
    ref = ReferenceFixtures()
    tmp = Path(tempfile.mkdtemp())
    models = {layout: load_model(build_tiny_checkpoint(tmp / layout, layout=layout)) for layout in ("original", "mlx")}
    print("\n| case | layout | prefill max abs diff | decode-step max abs diff | 32 greedy ids identical |")
    print("|---|---|---|---|---|")
    for name in ref.cases:
        for layout, model in models.items():
            if layout == "mlx" and name.startswith("img"):
                continue
            pre, dec, same = measure(model, ref, name)
            print(f"| {name} | {layout} | {pre:.2e} | {dec:.2e} | {same} |")

    model = models["original"]
    for chunk in (7, 24):
        for name in ("text_long", "img_middle"):
            case = ref(name)
            d = mx.abs(prefill(model, case) - chunked_prefill(model, case, chunk)).max().item()
            print(f"chunked prefill (chunk {chunk}) vs one-shot, {name}: {d:.2e}")

    bf16 = load_model(build_tiny_checkpoint(tmp / "bf16", dtype="bfloat16"))
    for name in ("text_long", "img_448"):
        case = ref(name)
        a = np.array(prefill(bf16, case).astype(mx.float32))
        b = np.array(prefill(model, case))
        print(
            f"bf16 vs fp32 prefill logits, {name}: max abs diff {np.abs(a - b).max():.3f} "
            f"(nan: {bool(np.isnan(a).any())}; fp32 logit range +-{np.abs(b).max():.1f})"
        )

    language = sys.modules[type(model.language_model).__module__]
    contiguous = lambda section, half: np.repeat(np.arange(3), section).astype(np.int32)  # noqa: E731
    with patched(language, "mrope_axis_table", contiguous):
        broken = load_model(build_tiny_checkpoint(tmp / "neg1"))
        pre, _, same = measure(broken, ref, "img_448")
        print(f"negative control, contiguous-section MRoPE: img_448 prefill diff {pre:.2e}, greedy identical {same}")
    wide = lambda L, K, window, f=language.causal_mask: f(L, K, None if window is None else window + 1)  # noqa: E731
    with patched(language, "causal_mask", wide):
        pre, _, same = measure(model, ref, "text_long")
        print(f"negative control, window one token too wide: text_long prefill diff {pre:.2e}, greedy identical {same}")


if __name__ == "__main__":
    main()
