"""Record transformers' image pixel bounds for cohere_compass folders into a fixture.

The folders have the published layouts of the files that decide the bounds (see the
"pixel bounds" section of the vendored image_processing_cohere_compass.py for the precedence):

- ``cohere_original``: CohereLabs' files: preprocessor_config.json says 65536 / 16777216,
  tokenizer_config.json says min_pixels 16384 / max_pixels 3868706;
- ``mlx_conversion``: what mlx-vlm >= 0.6.13's converter writes: the same two files plus
  processor_config.json whose ``image_processor`` block says 16384 / 3868706;
- folders where the files disagree, or hold only some of the keys.

Each case (a folder, from_pretrained kwargs, call kwargs) is run through the reference
(transformers >= 5.21's ``CohereCompassProcessor`` built by hand from ``AutoTokenizer`` and
``CohereCompassImageProcessorPil``: AutoProcessor needs torchvision for the video processor)
on two images, 224x224 and 4032x3024. Recorded per case: the bounds the reference's image
processor resizes within (its merged call kwargs, standardized as its ``preprocess`` does),
and per image the image token count, the grid and a summary of ``pixel_values``.

    .venvs/mlxvlm-0.7.10/bin/python scripts/reference/pixel_bounds.py [--check]

Writes tests/fixtures/pixel_bounds.json (``--check``: compare instead, exit 1 on a
difference). The case table is tests/support/pixel_bounds.py; tests/test_pixel_bounds.py compares the
vendored processor with the fixture on every pin and with the live reference where it is
installed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import warnings

from tests.support.pixel_bounds import (
    CASES,
    FIXTURE,
    IMAGES,
    build_folder,
    make_image,
    reference_bounds,
    reference_processor,
    reference_run,
    summarize,
)


def record() -> dict:
    import transformers

    warnings.simplefilter("ignore", FutureWarning)  # min/max_pixels call kwargs are "deprecated"
    images = {name: make_image(name) for name in IMAGES}
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, (folder_name, load_kwargs, call_kwargs) in CASES.items():
            folder = build_folder(folder_name, pathlib.Path(tmp) / folder_name)
            processor = reference_processor(folder, load_kwargs)
            runs = {}
            for name, image in images.items():
                run = reference_run(processor, image, call_kwargs)
                runs[name] = {
                    "tokens": run["tokens"],
                    "grid": run["grid"],
                    "pixel_values": summarize(run["pixel_values"]),
                }
            cases[case] = {
                "folder": folder_name,
                "load_kwargs": load_kwargs,
                "call_kwargs": call_kwargs,
                "bounds": reference_bounds(processor, call_kwargs),
                "images": runs,
            }
            print(
                f"{case:45s} bounds {cases[case]['bounds']}  "
                + "  ".join(f"{n}: {r['tokens']} tokens" for n, r in runs.items()),
                flush=True,
            )
    return {
        "made_by": "scripts/reference/pixel_bounds.py",
        "reference": f"transformers {transformers.__version__} CohereCompassProcessor "
        "(AutoTokenizer + CohereCompassImageProcessorPil)",
        "images": {name: list(hw) for name, hw in IMAGES.items()},
        "cases": cases,
    }


def _dump(data: dict) -> str:
    """JSON with one line per case (the file stays small and diffs by case)."""
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = [f"  {json.dumps(case)}: {json.dumps(entry)}" for case, entry in data["cases"].items()]
    return json.dumps(head, indent=1)[:-2] + ',\n "cases": {\n' + ",\n".join(lines) + "\n }\n}\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the fixture instead of writing it")
    args = parser.parse_args(argv)
    try:
        import transformers.models.cohere_compass  # noqa: F401
    except ImportError:
        raise SystemExit("the reference is transformers >= 5.21 (the mlx-vlm 0.7.10 env); not installed here")
    data = record()
    text = _dump(data)
    if args.check:
        if FIXTURE.read_text(encoding="utf-8") != text:
            print(f"{FIXTURE} differs from the reference", file=sys.stderr)
            return 1
        print(f"{FIXTURE} matches the reference")
        return 0
    FIXTURE.write_text(text, encoding="utf-8")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
