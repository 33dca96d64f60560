"""Record what transformers' cohere_compass computes on the tiny checkpoint.

Every parity test of the project compares against these files, so that suites running on old
mlx-vlm pins (where torch or a new transformers cannot be installed) still compare against the
reference implementation. Needs torch and transformers >= 5.21 (CohereCompassForConditionalGeneration,
interleaved MRoPE):

    .venvs/mlxvlm-0.7.10/bin/python scripts/reference/model_outputs.py

The script builds the default tiny checkpoint (compass_data.tiny, original layout, float32),
loads it with ``CohereCompassForConditionalGeneration.from_pretrained(..., dtype=float32,
attn_implementation="eager")`` on CPU, writes the synthetic test images to tests/fixtures/images/
and, for each case, records into tests/fixtures/reference/<case>.safetensors:

- ``input_ids`` [1, L]: the chat template rendered with ``tokenize=False``, every
  ``<|IMAGE_PAD|>`` expanded to t*(h/2)*(w/2) pads, then ``tokenizer(text, add_special_tokens=False)``
  (checked equal to what CohereCompassProcessor itself produces);
- ``prefill_logits`` [L, V]: logits at every position of one forward pass;
- ``greedy_ids`` [32], ``greedy_logits`` [32, V]: argmax decoding without stopping at EOS,
  recomputing the full sequence at each step with no cache (positions follow the reference's own
  rules); a cached decode is checked to agree;
- image cases also: ``pixel_values`` (packed, see below), ``image_grid_thw``, ``mm_token_type_ids``,
  ``position_ids`` [3, 1, L] and ``rope_deltas`` from ``get_rope_index``, ``image_features`` (the
  vision pooler output, images concatenated) and ``deepstack_features`` [K, n, hidden].

``pixel_values`` [N, 3*2*16*16] would dominate the fixtures' size, so they are stored losslessly
packed (``pack_pixel_values``): the first of the two identical temporal slots only, as uint8 codes
into a per-channel table of the float32 values. tests/support/cases.py unpacks them.
The cases, the images and the recording are in tests/support/model_outputs.py (the tests re-record
with it); this script writes what it records.

tests/fixtures/reference/index.json holds the metadata: versions, the weights' sha256, the cases
with their messages, rendered prompt and greedy ids.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Dict, Optional, Sequence

import numpy as np

from tests.support.model_outputs import REFERENCE_DIR, record


def save(results: Dict[str, Dict[str, np.ndarray]], index: dict, out_dir: pathlib.Path = REFERENCE_DIR) -> None:
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.safetensors"):
        stale.unlink()
    for name, arrays in results.items():
        path = out_dir / f"{name}.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, path)
        path.chmod(0o644)
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=REFERENCE_DIR, help="fixture directory")
    args = parser.parse_args(argv)
    results, index = record(write_images_too=True)
    save(results, index, args.out)
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {len(results)} cases to {args.out} ({total / 2**20:.1f} MiB)")
    for name, case in index["cases"].items():
        print(
            f"  {name:12s} L={case['seq_len']:4d} margin={case['greedy_min_margin']:.3f} greedy={case['greedy_ids'][:12]}"
        )


if __name__ == "__main__":
    main()
