#!/usr/bin/env python3
"""End to end: oMLX's engine (`omlx serve`, PyPI flyto-mlx 0.7.0) against
`python -m compass_compat generate` (scripts/hosts/common/e2e.py; run by scripts/hosts/omlx/run.sh).

`omlx serve --model-dir` serves every subfolder of OUT/models, the folder name being the model id
requests name; every run gets a fresh `--base-path` (no paged SSD cache, vision cache or settings
from an earlier run) and `--log-level debug`, whose vision-feature cache lines the notes count.
Before the server, the prompt check runs in this process: oMLX's own prompt pipeline (its request
model, message extraction and VLMBatchedEngine._process_chat_messages, called, not copied)
against the CLI's (compass_compat.cli.main), comparing what each hands mlx-vlm's prepare_inputs
(the prompt string) and what prepare_inputs returns (input_ids, pixel_values, image_grid_thw, ...)
bit for bit. Requests: oMLX's set (the standard one less g and h) plus `v`, a video_url part
(the demo clip) with text: oMLX 0.7.0 drops video parts before mlx-vlm sees them (docs/hosts.md),
so `v` must be answered, and its prompt built, as the text alone; when oMLX starts passing videos
it fails and the docs need the new behaviour. oMLX strips the surrounding whitespace of a
non-streamed reply (`clean_special_tokens`): such a reply equals "trimmed".
"""

from __future__ import annotations

import contextlib
import importlib
import io
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scripts.hosts.common.e2e import (  # noqa: E402
    Case,
    Host,
    Phase,
    console_script,
    generate_argv,
    log,
    main,
    openai_body,
    standard_cases,
)


def cases() -> List[Case]:
    from compass_compat.cli.generate import DEMO_IMAGE

    clip = str(Path(DEMO_IMAGE).with_name("demo_clip.avi"))
    video = Case("v", [], "Describe this picture.", "video part: oMLX drops it, = the text alone (documented)")
    video.dropped_videos = [clip]
    return [c for c in standard_cases() if c.name not in ("g", "h")] + [video]


def command(model_dir: Path, port: int) -> List[str]:
    base = model_dir.parent.parent / "base"
    shutil.rmtree(base, ignore_errors=True)  # a fresh base path for every server start
    return [
        *console_script("omlx"), "serve", "--model-dir", str(model_dir.parent), "--base-path", str(base),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "debug",
    ]  # fmt: skip


def vision_cache_notes(segment: str) -> List[str]:
    """What oMLX's vision-feature cache did (its debug lines): hits, stored misses, failures."""
    hits = segment.count("Vision feature cache hit")
    misses = segment.count("Vision feature cache miss")
    failed = segment.count("Vision feature computation failed")
    notes = [f"vision cache {hits} hit / {misses} miss"] if hits or misses else []
    if failed:
        notes.append(f"{failed} not cacheable (oMLX: 'Vision feature computation failed, using full pipeline')")
    return notes


class _Capture:
    """Wraps a module's prepare_inputs; records (prompts, outputs) of every call."""

    def __init__(self, module: Any):
        self.module, self.original = module, module.prepare_inputs
        self.calls: List[Tuple[Any, Dict[str, Any]]] = []

    def __enter__(self) -> "_Capture":
        def wrapper(processor, *args, **kwargs):
            out = self.original(processor, *args, **kwargs)
            self.calls.append((kwargs.get("prompts"), dict(out)))
            return out

        self.module.prepare_inputs = wrapper
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.prepare_inputs = self.original


def _arrays_equal(a: Any, b: Any) -> bool:
    import numpy as np

    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def _first(prompt: Any) -> Any:
    return prompt[0] if isinstance(prompt, list) else prompt


def prompt_check(model_dir: Path, cases: List[Case], max_tokens: int) -> Dict[str, Dict[str, Any]]:
    """Per case: do the host and the CLI feed mlx-vlm's prepare_inputs the same prompt and images?"""
    # mlx_vlm.generate is also the name of a function in mlx_vlm's namespace: import by name.
    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    vutils = importlib.import_module("mlx_vlm.utils")
    from mlx_vlm import load
    from omlx.api.openai_models import ChatCompletionRequest
    from omlx.api.utils import extract_multimodal_content
    from omlx.engine.vlm import VLMBatchedEngine
    from omlx.models.vlm import VLMModelAdapter

    import compass_compat.cli as cli

    model, processor = load(str(model_dir))
    engine = VLMBatchedEngine(model_name=str(model_dir))
    # What start() sets, without starting the scheduler: the loaded model and processor, the
    # tokenizer, and no vision-feature cache (it would only skip the encoder, not change inputs).
    engine._vlm_model, engine._processor = model, processor
    engine._tokenizer = getattr(processor, "tokenizer", processor)
    engine._vision_cache = None
    # With mRoPE oMLX's adapter decodes with position_ids from the batch cache offsets plus per-request rope deltas.
    log("omlx", f"oMLX VLMModelAdapter sees mRoPE: {VLMModelAdapter._detect_mrope(model)}")

    report: Dict[str, Dict[str, Any]] = {}
    for case in cases:
        entry: Dict[str, Any] = {"ok": False}
        try:
            # Reference: the CLI's own code path (max 1 token; only the inputs matter here).
            with _Capture(dispatch) as ref, contextlib.redirect_stdout(io.StringIO()):
                rc = cli.main(generate_argv(model_dir, case, 1))
            if rc != 0 or len(ref.calls) != 1:
                raise RuntimeError(f"reference generate returned {rc} with {len(ref.calls)} prepare_inputs calls")
            ref_prompt, ref_out = ref.calls[0]
            # Host: the server's steps for /v1/chat/completions on a VLMBatchedEngine.
            req = ChatCompletionRequest(**openai_body(case, max_tokens, case.stream))
            extract = engine.message_extractor or extract_multimodal_content
            messages = extract(req.messages, None, engine.tokenizer)
            with _Capture(vutils) as host:
                token_ids = engine._process_chat_messages(messages, None, {})[0]
            if not host.calls:
                raise RuntimeError("the host never called prepare_inputs")
            host_prompt, host_out = host.calls[0]
            entry["prompt_ref"], entry["prompt_host"] = _first(ref_prompt), _first(host_prompt)
            entry["prompt_tokens"] = int(ref_out["input_ids"].shape[-1])
            diffs = [] if entry["prompt_ref"] == entry["prompt_host"] else ["prompt string"]
            keys = sorted(k for k in {*ref_out, *host_out} if ref_out.get(k) is not None or host_out.get(k) is not None)
            diffs += [k for k in keys if not _arrays_equal(ref_out.get(k), host_out.get(k))]
            if list(token_ids) != ref_out["input_ids"][0].tolist():
                diffs.append("token_ids returned")
            entry.update(compared=["prompt string"] + keys, diffs=diffs, ok=not diffs)
            if case.name in ("a", "b"):  # one picture request and one text request, for the log
                log("omlx", f"host prompt of request {case.name}: {entry['prompt_host']!r}")
        except Exception as err:  # reported per case, the run goes on
            entry["error"] = f"{type(err).__name__}: {err}"
        report[case.name] = entry
    return report


HOST = Host(
    name="omlx",
    label="oMLX 0.7.0 (flyto-mlx)",
    distributions=["flyto-mlx", "mlx", "mlx-vlm", "mlx-lm", "transformers"],
    command=command,
    trimmed_ok=True,
    log_notes=vision_cache_notes,
    prompt_check=prompt_check,
    phases=lambda: [Phase("default", cases(), note="oMLX's defaults")],
)

if __name__ == "__main__":
    sys.exit(main(HOST))
