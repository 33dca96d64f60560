"""The pin-bump checklist: recorded verdicts per pin, and proof that its checks bite.

This file is the checklist's CI job: every pin environment of the matrix runs the suite, so
every pin runs ``python -m scripts.checklist`` here (in subprocesses, both against
upstream and against the vendored copy) and compares each item's verdict with the record the
shim decides by (compass_compat/verdicts.json, written by the pin-bump job). An upstream change
therefore turns the build red instead of drifting silently. (A pin's second run, with the switch
COMPASS_COMPAT_IMPLEMENTATION=upstream, skips what the checklist decides for itself.)

The broken-implementation tests run the checklist's own items against the vendored package with
one deliberate defect each (monkeypatched in a subprocess, where the vendored package is forced
live) and require the item concerned to FAIL, and unrelated items to keep passing; they run on
the oldest and the newest pin.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Optional

import mlx_vlm
import pytest

import compass_compat
from scripts import checklist
from tests.lib.vendored import default_run_only, switch_from_env, upstream_ships

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "compass_compat" / "verdicts.json"
MLX_VLM_VERSION = str(mlx_vlm.__version__)
# Whether this mlx-vlm ships its own models/cohere_compass (0.6.13 was the first release that did).
UPSTREAM_SHIPS = upstream_ships()
TIMEOUT = 900
ENVS = re.search(r"ALL_ENVS=\(([^)]*)\)", (REPO / "scripts" / "env" / "pins.sh").read_text()).group(1).split()
# The defects are the vendored package's, the same code on every pin; the oldest pin (transformers
# 4, the naive detokenizer) and the newest (the guarded one) cover both branches item 10 has.
DEFECT_PINS = {ENVS[0].split("-")[0], ENVS[-1].split("-")[0]}
defect_pins_only = pytest.mark.skipif(
    MLX_VLM_VERSION not in DEFECT_PINS or switch_from_env() == "upstream",
    reason=f"the deliberate defects run in the default runs of mlx-vlm {' and '.join(sorted(DEFECT_PINS))} "
    "(the oldest and the newest pin); the vendored code they break is the same on every pin",
)


def run_checklist(*args: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python -m scripts.checklist ARGS`` in this pin's interpreter (inherits the env,
    so the forced 0.7.10 matrix pass also shows the checklist picks its own target)."""
    return subprocess.run(
        [sys.executable, "-m", "scripts.checklist", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def run_json(*args: str) -> Dict[str, Any]:
    proc = run_checklist("--json", *args)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checklist printed no JSON (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    assert proc.returncode == report["exit_code"], "exit status differs from the report's exit_code"
    return report


def expected_verdicts() -> Dict[str, Dict[str, Dict[str, str]]]:
    """The record, read as data: release -> implementation -> item -> verdict."""
    releases = json.loads(RECORD.read_text(encoding="utf-8"))["releases"]
    return {r: {k: entry[k] for k in ("upstream", "vendored")} for r, entry in releases.items()}


def describe(report: Dict[str, Any]) -> str:
    return "\n".join(f"  {r['item']} {r['verdict']}: {r['evidence']}" for r in report["items"])


@pytest.fixture(scope="module")
def upstream_report() -> Dict[str, Any]:
    return run_json("--implementation", "upstream")


@pytest.fixture(scope="module")
def vendored_report() -> Dict[str, Any]:
    return run_json("--implementation", "vendored")


# ----------------------------------------------------- the recorded verdicts


def test_the_record_covers_every_item_of_every_pin():
    block = expected_verdicts()
    pins = {env.split("-")[0] for env in ENVS}  # an environment is "<mlx-vlm version>[-<tag>]"
    missing = pins - set(block)
    assert not missing, (
        f"compass_compat/verdicts.json must record every mlx-vlm version of scripts/env/pins.sh: {missing}"
    )
    for pin, per_impl in block.items():
        assert sorted(per_impl) == ["upstream", "vendored"], pin
        for verdicts in per_impl.values():
            assert sorted(verdicts, key=int) == [str(n) for n in checklist.ITEM_NUMBERS], pin
            assert set(verdicts.values()) <= {"PASS", "FAIL"}, pin


@pytest.mark.parametrize("implementation", ["upstream", "vendored"])
@default_run_only  # the checklist picks its implementation itself
def test_verdicts_match_the_record(implementation, upstream_report, vendored_report):
    report = upstream_report if implementation == "upstream" else vendored_report
    block = expected_verdicts()
    assert MLX_VLM_VERSION in block, (
        f"compass_compat/verdicts.json records no verdicts for mlx-vlm {MLX_VLM_VERSION}; this run measured:\n"
        + describe(report)
    )
    assert report["error"] is None, report["error"]
    assert report["mlx_vlm_version"] == MLX_VLM_VERSION
    want = block[MLX_VLM_VERSION][implementation]
    assert report["verdicts"] == want, (
        f"mlx-vlm {MLX_VLM_VERSION}, {implementation}: the checklist's verdicts changed; look at the "
        f"evidence, then fix the code or record the release again (bash scripts/pin_bump/pin_bump.sh "
        f"{MLX_VLM_VERSION}):\n" + describe(report)
    )
    all_pass = all(v == "PASS" for v in want.values())
    assert report["exit_code"] == (0 if all_pass else 1)


@default_run_only
def test_vendored_copy_passes_what_it_must(vendored_report):
    """Ours passes the model items on every pin: the checks can be met."""
    verdicts = vendored_report["verdicts"]
    model_items = ("2", "3", "4", "7", "8", "9", "10", "11")
    assert {n: verdicts[n] for n in model_items} == dict.fromkeys(model_items, "PASS"), describe(vendored_report)
    assert vendored_report["live_package"].endswith(os.path.join("mlx_vlm", "models", "cohere_compass"))
    assert "/vendor/" in vendored_report["live_package"] or "/_vendor/" in vendored_report["live_package"]


@default_run_only
def test_upstream_run_targets_upstream(upstream_report):
    if UPSTREAM_SHIPS:
        live = upstream_report["live_package"]
        assert live and not checklist.within(live, compass_compat.vendor_root()), live
        assert upstream_report["verdicts"]["1"] == "PASS"
    else:
        assert upstream_report["live_package"] is None
        by_item = {r["item"]: r for r in upstream_report["items"]}
        for n in (1, 2, 3, 4, 6, 8, 9, 10):
            assert by_item[n]["verdict"] == "FAIL"
            assert "no upstream cohere_compass" in by_item[n]["evidence"]
        # Meaningful on every pin: the vendored code's imports, and the pristine MODEL_CONFIG.
        assert by_item[7]["verdict"] == "PASS"
        assert "pristine" in by_item[5]["evidence"]


@default_run_only
def test_every_item_reports_evidence(upstream_report, vendored_report):
    for report in (upstream_report, vendored_report):
        assert [r["item"] for r in report["items"]] == list(checklist.ITEM_NUMBERS)
        for r in report["items"]:
            assert r["verdict"] in ("PASS", "FAIL") and r["evidence"].strip(), r


# ------------------------------------------------------------ the command


def test_table_output_and_exit_status():
    proc = run_checklist("--implementation", "vendored", "--items", "1,7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"compass-compat pin-bump checklist: mlx-vlm {MLX_VLM_VERSION}, implementation vendored")
    assert any(re.match(r"^1\s+PASS\s+the vendored copy ships cohere_compass", line) for line in lines)
    assert any(re.match(r"^7\s+PASS\s+the rotary helpers", line) for line in lines)
    assert lines[-1].startswith("2/2 items pass") and "(exit 0)" in lines[-1]


@default_run_only
def test_missing_fixtures_exit_2_and_say_why(tmp_path):
    proc = run_checklist("--fixtures", str(tmp_path / "nowhere"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "COULD NOT RUN" in proc.stdout and "reference fixtures not found" in proc.stdout
    report = run_json("--fixtures", str(tmp_path / "nowhere"))
    assert report["exit_code"] == 2 and report["items"] == [] and "not shipped in the wheel" in report["error"]


@default_run_only
def test_unknown_item_is_a_usage_error():
    proc = run_checklist("--items", str(max(checklist.ITEM_NUMBERS) + 1))
    assert proc.returncode == 2 and "unknown checklist item" in proc.stderr


def test_exit_status_semantics():
    def report(*verdicts: str, error: Optional[str] = None) -> checklist.Report:
        items = [checklist.ItemResult(n, "t", v, "e") for n, v in enumerate(verdicts, 1)]
        return checklist.Report("upstream", "x", None, None, items, 0.0, error)

    assert report("PASS", "PASS").exit_code == 0
    assert report("PASS", "FAIL").exit_code == 1
    assert report(error="no fixtures").exit_code == 2
    assert report().exit_code == 2  # nothing checked is no verdict


def test_import_scan_finds_the_rotary_helper():
    found = {(target, name) for _, target, names in checklist.external_imports() for name in names}
    assert ("mlx_lm.models.rope_utils", "initialize_rope") in found
    assert ("mlx_vlm.models.cache", "RotatingKVCache") in found  # `from ..cache import ...`, resolved
    assert not any(t.startswith(checklist.PACKAGE) for t, _ in found)  # the package's own modules


def test_smart_resize_expectations_are_exact_arithmetic():
    # Image preprocessing: 448x448 stays, 20x20 grows to the min bound, 640x480 shrinks.
    assert checklist.smart_resize(448, 448, 32, 65536, 16777216) == (448, 448)
    assert checklist.smart_resize(20, 20, 32, 65536, 16777216) == (256, 256)
    assert checklist.smart_resize(480, 640, 32, 16384, 65536) == (192, 288)
    assert checklist.smart_resize(64, 64, 32, 16384, 65536) == (128, 128)


# ---------------------------------------------- the checks catch real defects

DEFECTS_DRIVER = textwrap.dedent(
    '''
    """Run checklist items against the vendored package with one deliberate defect at a time."""
    import importlib, json, sys
    import numpy as np
    import compass_compat
    from scripts import checklist

    compass_compat.apply_patch(force_vendored=True)  # the vendored package is the live one
    language = importlib.import_module("mlx_vlm.models.cohere_compass.language")
    model_module = importlib.import_module("mlx_vlm.models.cohere_compass.cohere_compass")
    processing = importlib.import_module("mlx_vlm.models.cohere_compass.processing_cohere_compass")
    image_processing = importlib.import_module("mlx_vlm.models.cohere_compass.image_processing_cohere_compass")

    def sliding_window_off_by_one():
        original = language.causal_mask
        language.causal_mask = lambda L, K, window: original(L, K, None if window is None else window + 1)
        return lambda: setattr(language, "causal_mask", original)

    def contiguous_mrope():
        # transformers 5.18-5.20's layout: [T]*s0 + [H]*s1 + [W]*s2 instead of interleaved slots.
        original = language.mrope_axis_table
        def contiguous(section, half_dim):
            axes = np.concatenate([np.full(n, axis, np.int32) for axis, n in enumerate(section)])
            assert len(axes) == half_dim
            return axes
        language.mrope_axis_table = contiguous
        return lambda: setattr(language, "mrope_axis_table", original)

    def processor_ignores_preprocessor_config():
        cls = processing.CohereCompassImageProcessor
        original = cls.__dict__["from_dict"]
        cls.from_dict = classmethod(lambda c, values, **kw: original.__func__(c, {}, **kw))
        return lambda: setattr(cls, "from_dict", original)

    def processor_ignores_tokenizer_pixel_bounds():
        # The old processor's mistake: tokenizer_config.json's min/max_pixels not merged in.
        # Only while the processor loads: the checklist's expectation uses the same resolver.
        cls = processing.CohereCompassProcessor
        original, resolve = cls.__dict__["from_pretrained"], image_processing.resolve_pixel_bounds
        def without_tokenizer(image_config, image_config_file=None, tokenizer_config=None, *args, **kwargs):
            return resolve(image_config, image_config_file, None, *args, **kwargs)
        def from_pretrained(c, *args, **kwargs):
            image_processing.resolve_pixel_bounds = without_tokenizer
            try:
                return original.__func__(c, *args, **kwargs)
            finally:
                image_processing.resolve_pixel_bounds = resolve
        cls.from_pretrained = classmethod(from_pretrained)
        return lambda: setattr(cls, "from_pretrained", original)

    def detokenizer_unguarded():
        cls = processing.CohereCompassProcessor
        original = cls.__dict__["detokenizer"]
        cls.detokenizer = property(lambda self: self.__dict__["_detokenizer"],
                                   lambda self, value: self.__dict__.__setitem__("_detokenizer", value))
        return lambda: setattr(cls, "detokenizer", original)

    def replay_drops_deepstack():
        cls = model_module.Model
        original = cls.get_input_embeddings
        def get_input_embeddings(self, *args, cached_image_features=None, **kwargs):
            if cached_image_features is not None:
                width = self.config.text_config.hidden_size
                import mlx.core as mx
                kept = cached_image_features[:, :width]  # the deepstack columns zeroed
                cached_image_features = mx.concatenate([kept, mx.zeros_like(cached_image_features[:, width:])], axis=-1)
            return original(self, *args, cached_image_features=cached_image_features, **kwargs)
        cls.get_input_embeddings = get_input_embeddings
        return lambda: setattr(cls, "get_input_embeddings", original)

    def video_untimestamped():
        # A contiguous-time video prompt: one block of all the pads, no <t seconds> per patch.
        cls = processing.CohereCompassProcessor
        original = cls._video_blocks
        def contiguous(self, grids, settled, video_kwargs):
            blocks, total = original(self, grids, settled, video_kwargs)
            pads = [block.count(self.video_token) for block in blocks]
            return [self.vision_start_token + self.video_token * n + self.vision_end_token for n in pads], total
        cls._video_blocks = contiguous
        return lambda: setattr(cls, "_video_blocks", original)

    DEFECTS = {
        "sliding_window_off_by_one": sliding_window_off_by_one,
        "contiguous_mrope": contiguous_mrope,
        "processor_ignores_preprocessor_config": processor_ignores_preprocessor_config,
        "processor_ignores_tokenizer_pixel_bounds": processor_ignores_tokenizer_pixel_bounds,
        "replay_drops_deepstack": replay_drops_deepstack,
        "detokenizer_unguarded": detokenizer_unguarded,
        "video_untimestamped": video_untimestamped,
    }
    plan = json.loads(sys.argv[1])
    results = {}
    for name, items in plan.items():
        undo = DEFECTS[name]()
        try:
            report = checklist.run_checklist("vendored", items)
        finally:
            undo()
        results[name] = report.to_json()
    print("DEFECTS-JSON " + json.dumps(results))
    '''
)

PLAN = {
    "sliding_window_off_by_one": [2],
    "contiguous_mrope": [2, 3],
    "processor_ignores_preprocessor_config": [3],
    "processor_ignores_tokenizer_pixel_bounds": [3],
    "replay_drops_deepstack": [4],
    "detokenizer_unguarded": [10],
    "video_untimestamped": [3, 11],
}


@pytest.fixture(scope="module")
def defects() -> Dict[str, Dict[str, Any]]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("COMPASS_COMPAT_FORCE_VENDORED", "COMPASS_COMPAT_IMPLEMENTATION")
    }
    proc = subprocess.run(
        [sys.executable, "-c", DEFECTS_DRIVER, json.dumps(PLAN)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
        env=env,
    )
    line = next((row for row in proc.stdout.splitlines() if row.startswith("DEFECTS-JSON ")), None)
    assert line, f"defect driver failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(line[len("DEFECTS-JSON ") :])
    for name, report in results.items():
        assert report["error"] is None, f"{name}: {report['error']}"
        assert report["live_package"] and "vendor" in report["live_package"], name
    return results


def item(report: Dict[str, Any], number: int) -> Dict[str, Any]:
    return next(r for r in report["items"] if r["item"] == number)


@defect_pins_only
def test_broken_sliding_window_fails_item_2(defects):
    r = item(defects["sliding_window_off_by_one"], 2)
    assert r["verdict"] == "FAIL", r["evidence"]
    assert "text_long" in r["evidence"] and "max|dlogits|" in r["evidence"]


@defect_pins_only
def test_contiguous_mrope_fails_item_3_only(defects):
    report = defects["contiguous_mrope"]
    image = item(report, 3)
    assert image["verdict"] == "FAIL", image["evidence"]
    assert "positions equal 5/5" in image["evidence"]  # the positions are right; the rotation is not
    # Text-only prompts have equal position axes, where any slot layout is plain RoPE.
    assert item(report, 2)["verdict"] == "PASS", item(report, 2)["evidence"]


@defect_pins_only
def test_processor_ignoring_preprocessor_config_fails_item_3(defects):
    r = item(defects["processor_ignores_preprocessor_config"], 3)
    assert r["verdict"] == "FAIL", r["evidence"]
    assert "image files not honoured" in r["evidence"]
    probe = r["details"]["preprocessor_config"]
    # The bounds are tokenizer_config.json's, still merged in; the mean/std are lost.
    assert probe["640x480"]["grid"] == probe["640x480"]["expected_grid"]
    assert probe["solid 64x64"]["max_abs"] > 0.1


@defect_pins_only
def test_processor_ignoring_tokenizer_pixel_bounds_fails_item_3(defects):
    r = item(defects["processor_ignores_tokenizer_pixel_bounds"], 3)
    assert r["verdict"] == "FAIL", r["evidence"]
    probe = r["details"]["preprocessor_config"]
    assert probe["640x480"]["grid"] != probe["640x480"]["expected_grid"]
    assert probe["solid 64x64"]["max_abs"] <= 1e-5


@defect_pins_only
def test_replay_dropping_deepstack_fails_item_4(defects):
    r = item(defects["replay_drops_deepstack"], 4)
    assert r["verdict"] == "FAIL", r["evidence"]
    assert all(case["max_abs"] > 1e-3 for case in r["details"]["cases"]), r["details"]


def naive_detokenizer(folder) -> bool:
    """Whether this mlx-vlm's load_tokenizer picks NaiveStreamingDetokenizer for the tiny tokenizer
    (0.3.9 does: it decodes through the tokenizer, so padding ids cannot raise)."""
    from mlx_vlm.tokenizer_utils import load_tokenizer

    chosen = load_tokenizer(Path(folder), return_tokenizer=False)
    return getattr(chosen, "func", chosen).__name__ == "NaiveStreamingDetokenizer"


@defect_pins_only
def test_unguarded_detokenizer_fails_item_10(defects, tiny_ckpt_original):
    r = item(defects["detokenizer_unguarded"], 10)
    if naive_detokenizer(tiny_ckpt_original):  # nothing to guard
        assert r["verdict"] == "PASS" and "NaiveStreamingDetokenizer" in r["evidence"], r["evidence"]
    else:
        assert r["verdict"] == "FAIL" and "IndexError" in r["evidence"], r["evidence"]


@defect_pins_only
def test_untimestamped_video_prompt_fails_item_11_only(defects):
    report = defects["video_untimestamped"]
    r = item(report, 11)
    assert r["verdict"] == "FAIL", r["evidence"]
    assert "prompt ids differ" in r["evidence"] and "processor ids = reference (timestamps) 0/4" in r["evidence"]
    assert item(report, 3)["verdict"] == "PASS", item(report, 3)["evidence"]  # images are unaffected
