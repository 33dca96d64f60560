"""The caller contract on the control, a survey of the installed mlx-vlm: which contract items
mlx-vlm's own ``qwen3_vl`` (a tiny random checkpoint, scripts/_lib/control.py) passes, driven by
exactly the calls tests/test_caller_contract.py makes on ours (scripts/_lib/contract.py) and
compared with its own one-shot forward pass.

    python -m scripts.pin_bump.control_survey [--json OUT]     (in a pin's environment; pin_bump.sh runs it)

It monitors mlx-vlm, not this project: where the control fails an item, the pin's own model (or the
host convention the item stands for) is at fault and ours is made right anyway. The failures
measured per release are recorded in scripts/pin_bump/control_expected.json; an item that starts
to pass, or a new failure, tells the maintainer a convention changed (docs/model-contract.md).
Prints one line per item and a summary; exit 0 when the failures are the recorded ones, 1 when they
differ or the release has no record.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Tuple

EXPECTED = Path(__file__).resolve().parent / "control_expected.json"
ALL = ["text_short", "text_long", "image", "two_images"]
TEXT = ["text_short", "text_long"]


def items(model, cases) -> List[Tuple[str, Callable[[], None]]]:
    """(item id, its driver call) for every contract item the control can be driven through."""
    from scripts._lib import contract as c

    out: List[Tuple[str, Callable[[], None]]] = []
    for name in ALL:
        for style in sorted(c.DECODES):
            out.append(
                (f"whole_prefill_then_decode[{name}-{style}]", lambda n=name, s=style: c.item_whole(model, cases[n], s))
            )
    for name in TEXT:
        out.append(
            (f"text_prefill_in_chunks_through_model_call[{name}]", lambda n=name: c.item_model_chunks(model, cases[n]))
        )
    for name in ALL:
        out.append(
            (
                f"prefill_in_chunks_with_the_whole_prompts_kwargs[{name}]",
                lambda n=name: c.item_lm_chunks(model, cases[n]),
            )
        )
    for name in TEXT:
        for mode in c.SUFFIX_MODES:
            out.append(
                (
                    f"text_suffix_after_a_restored_prefix[{name}-{mode}]",
                    lambda n=name, m=mode: c.item_restored(model, cases[n], cases[n].length // 2, m),
                )
            )
    for name in ("image", "two_images"):
        for mode in ("model-call", "primed"):
            out.append(
                (
                    f"text_suffix_after_a_restored_image_prefix[{name}-{mode}]",
                    lambda n=name, m=mode: c.item_restored(model, cases[n], cases[n].vision_end + 2, m),
                )
            )
    if c.has_batch_caches():
        for name in ALL:
            out.append(
                (
                    f"decode_in_a_one_row_batch_cache_with_nothing_passed[{name}]",
                    lambda n=name: c.item_one_row_batch(model, cases[n]),
                )
            )
    for style in ("neither", "rope_deltas"):
        out.append(
            (
                f"two_requests_decoded_in_turn_keep_their_own_delta[{style}]",
                lambda s=style: c.item_interleaved(model, cases["image"], cases["text_long"], s),
            )
        )
    if hasattr(c.make_cache_class(), "merge"):
        merged = [cases["text_long"], cases["image"], cases["two_images"], cases["text_short"]]
        out.append(("requests_merged_into_one_batch_cache_keep_their_own_delta", lambda: c.item_merged(model, merged)))
    return out


def survey() -> Dict[str, str]:
    """Item id -> "pass", or "fail: <why>" (the check's message, first line)."""
    from scripts._lib import contract as c
    from scripts._lib.control import build_control, load_control

    model = load_control(build_control(Path(tempfile.mkdtemp(prefix="control-"))))
    cases = {name: c.control_case(model, name) for name in ALL}
    result = {}
    for item, run in items(model, cases):
        try:
            run()
            result[item] = "pass"
        except Exception as err:  # a failed check or the control's own error: both are its failure
            result[item] = f"fail: {type(err).__name__}: " + (str(err).strip().splitlines() or [""])[0][:200]
    return result


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the survey (and the comparison) as JSON")
    args = parser.parse_args(argv)
    import compass_compat  # noqa: F401  (the patch, as the suite runs: the control is mlx-vlm's own)

    version = importlib.metadata.version("mlx-vlm")
    result = survey()
    failing = sorted(item for item, verdict in result.items() if verdict != "pass")
    expected = json.loads(EXPECTED.read_text(encoding="utf-8")).get(version)
    for item, verdict in result.items():
        print(f"{verdict[:4]:4}  {item}" + (f"  ({verdict[6:]})" if verdict != "pass" else ""))
    if expected is None:
        print(
            f"control: {len(failing)} of {len(result)} items fail on mlx-vlm {version}; no record for this release: "
            f'add {failing} under "{version}" in {EXPECTED.name}'
        )
        code = 1
    else:
        started, stopped = sorted(set(failing) - set(expected)), sorted(set(expected) - set(failing))
        print(
            f"control: {len(failing)} of {len(result)} items fail on mlx-vlm {version}; "
            + (
                "as recorded"
                if not (started or stopped)
                else f"now failing {started}, now passing {stopped}: "
                "a convention changed, see docs/model-contract.md, then update the record"
            )
        )
        code = 0 if not (started or stopped) else 1
    if args.json:
        args.json.write_text(json.dumps({"mlx_vlm": version, "result": result, "expected": expected}, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
