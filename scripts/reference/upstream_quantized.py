"""Record tests/fixtures/quantized_0710/: quantized MLX checkpoints made by UPSTREAM mlx-vlm 0.7.10.

Run once, in the 0.7.10 environment WITHOUT COMPASS_COMPAT_FORCE_VENDORED (so mlx-vlm's own
cohere_compass package and its converter do the work; the shim only stands by):

    .venvs/mlxvlm-0.7.10/bin/python scripts/reference/upstream_quantized.py

It builds the tiny checkpoint (compass_data.tiny, original CohereLabs layout, seed 0) and
runs ``mlx_vlm.convert.convert`` on it twice:

- ``q4_f32/``: float32 source, 4-bit, group 64, affine;
- ``q8_bf16/``: bfloat16 source, 8-bit, group 64, affine (the unquantized vision tower stays
  bfloat16, which keeps the pair under 2 MB).

Everything the converter writes is kept as written (config.json with ``quantization``, the
transformers-5 tokenizer files, processor_config.json, model.safetensors, its index, the
model card), plus ``provenance.json``. tests/test_quantized.py loads both through the shim
on every pin and checks they equal the pin's own conversion of the same source.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "quantized_0710"
RECIPES = {"q4_f32": ("float32", 4), "q8_bf16": ("bfloat16", 8)}
GROUP_SIZE = 64


def main() -> int:
    import mlx.core as mx
    import mlx_vlm
    import transformers
    from mlx_vlm.convert import convert

    import compass_compat
    from compass_data.tiny import build_tiny_checkpoint

    info = compass_compat.implementation_info()
    if info.mlx_vlm_version != "0.7.10" or info.implementation != "upstream" or info.forced:
        print(
            "run this in the mlx-vlm 0.7.10 env without COMPASS_COMPAT_FORCE_VENDORED: it records "
            f"upstream's converter, but the live cohere_compass is {info.implementation} "
            f"(mlx-vlm {info.mlx_vlm_version}, forced={info.forced})",
            file=sys.stderr,
        )
        return 1
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (dtype, bits) in RECIPES.items():
            source = build_tiny_checkpoint(pathlib.Path(tmp) / f"tiny_{dtype}", layout="original", dtype=dtype)
            print(
                f"[fixture] {name}: upstream mlx-vlm {mlx_vlm.__version__} convert -q --q-bits {bits} "
                f"--q-group-size {GROUP_SIZE} (source {dtype})",
                flush=True,
            )
            convert(str(source), mlx_path=str(OUT / name), quantize=True, q_bits=bits, q_group_size=GROUP_SIZE)
            (OUT / name / "provenance.json").write_text(
                json.dumps(
                    {
                        "made_by": "scripts/reference/upstream_quantized.py",
                        "converter": f"mlx_vlm.convert.convert (upstream mlx-vlm {mlx_vlm.__version__})",
                        "cohere_compass_implementation": info.implementation,
                        "cohere_compass_file": info.file,
                        "source": {
                            "builder": "compass_data.tiny.build_tiny_checkpoint",
                            "layout": "original",
                            "dtype": dtype,
                            "seed": 0,
                            "variant": "default",
                        },
                        "quantize": {"bits": bits, "group_size": GROUP_SIZE, "mode": "affine"},
                        "versions": {
                            "mlx-vlm": mlx_vlm.__version__,
                            "mlx": mx.__version__,
                            "transformers": transformers.__version__,
                        },
                    },
                    indent=2,
                )
                + "\n",
                encoding="utf-8",
            )
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"[fixture] wrote {OUT} ({total / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
