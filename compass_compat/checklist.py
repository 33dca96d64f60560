"""Pin-bump checklist: can the vendored ``cohere_compass`` be deleted at this mlx-vlm pin?

Run it in the environment of the mlx-vlm pin you are considering::

    python -m compass_compat.checklist [--json] [--implementation upstream|vendored]

Every item of ``CHECKLIST.md`` is checked automatically against the installed mlx-vlm and
reported as PASS or FAIL with its evidence (numbers, or the error). Exit status: 0 when every
item passes (upstream's package can replace the vendored copy), 1 when any item fails, 2 when
the checklist could not run (e.g. the reference fixtures are missing).

``--implementation upstream`` (the default) checks mlx-vlm's own ``cohere_compass``; items that
need it FAIL with "no upstream cohere_compass" on pins that do not ship it (before 0.6.13).
``--implementation vendored`` runs the same items against compass-compat's vendored package
(made live the documented way, ``apply_patch(force_vendored=True)``); that is how the tests show
the checks are meaningful. Either way the vendored package is also imported side by side under
a private module name for item 7, so both implementations are live in one process.

Ground truth is the reference fixtures recorded from transformers (``tests/fixtures`` of the
repository checkout, found next to the package, or ``--fixtures DIR``). They are not shipped in
the wheel: from an installed wheel the command exits 2 and says so.

Models are driven the way mlx-vlm drives them: ``mlx_vlm.load`` (model and processor, the
processor through ``AutoProcessor``), ``Model.__call__`` / ``get_input_embeddings`` for logits
and positions, ``mlx_vlm.generate.generate_step`` for greedy ids on the reference inputs and
``mlx_vlm.stream_generate`` for the whole prompt path (template text -> processor -> model).
Items 5 and 6 run in fresh interpreters that never import compass_compat (upstream mode), so
they see mlx-vlm exactly as a host without the shim does. Nothing is downloaded.

Note: running the checklist changes the process's compass-compat patch state (it selects the
implementation under test); it is meant to run as its own process.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

PASS, FAIL = "PASS", "FAIL"
UPSTREAM, VENDORED = "upstream", "vendored"
IMPLEMENTATIONS = (UPSTREAM, VENDORED)
MODEL_TYPE = "cohere_compass"
PACKAGE = f"mlx_vlm.models.{MODEL_TYPE}"
# The vendored package imported a second time, under its own name, next to the live one.
SIDE_BY_SIDE = "mlx_vlm.models._compass_checklist_vendored"
FIRST_UPSTREAM_RELEASE = "0.6.13"

LOGIT_TOL = 1e-4  # prefill logits vs the transformers reference (float32 both sides)
PIXEL_TOL = 1e-5  # pixel values vs the reference processor
N_GREEDY = 32
QUANT_GROUP, QUANT_BITS = 64, 4
# Quantized model vs a float model holding its dequantized weights: only summation order differs.
QUANT_TWIN_TOL = 1e-3
SUBPROCESS_TIMEOUT = 600

EXIT_PASS, EXIT_FAIL, EXIT_COULD_NOT_RUN = 0, 1, 2

__all__ = [
    "ITEMS",
    "CouldNotRun",
    "Item",
    "ItemResult",
    "Reference",
    "Report",
    "main",
    "run_checklist",
    "select_implementation",
    "smart_resize",
]


@dataclass(frozen=True)
class Item:
    """One checklist item: its number, its claim and why it matters.

    ``title`` names the implementation as ``{impl}`` (see :meth:`title_for`).
    """

    number: int
    title: str
    why: str

    def title_for(self, implementation: str) -> str:
        """The claim, about ``implementation`` ("upstream" or "vendored")."""
        return self.title.format(impl="the vendored copy" if implementation == VENDORED else implementation)


ITEMS: Tuple[Item, ...] = (
    Item(1, "{impl} ships cohere_compass", "without it mlx-vlm cannot load the model at all"),
    Item(
        2,
        "{impl}'s text path matches the reference (prefill logits within 1e-4, 32 greedy ids)",
        "a wrong window, norm or rope silently degrades every answer",
    ),
    Item(
        3,
        "{impl}'s image path matches the reference (pixels, image tokens, positions, logits, greedy ids; "
        "image files honoured; no double BOS)",
        "wrong pixels or MRoPE positions silently degrade every image answer",
    ),
    Item(
        4,
        "{impl} has a public encode_image; its cached replay logits identical to the uncached path (deepstack included)",
        "hosts that cache image features would silently lose the deepstack residuals",
    ),
    Item(
        5,
        "MODEL_CONFIG registers cohere_compass ({impl})",
        "an unregistered model type silently drops the images from the prompt",
    ),
    Item(
        6,
        "AutoProcessor builds {impl}'s processor for a checkpoint folder without torch",
        "hosts without torch could not load the model",
    ),
    Item(
        7,
        "the rotary helpers (and every other mlx-lm / mlx-vlm name) the vendored code imports exist at this pin",
        "the vendored copy itself would fail to import",
    ),
    Item(
        8,
        "a quantized checkpoint (4-bit, group 64) loads and generates through {impl}",
        "published MLX conversions are quantized",
    ),
    Item(
        9,
        "both weight layouts (original and MLX) load through {impl}",
        "CohereLabs checkpoints and MLX conversions use different key names",
    ),
    Item(
        10,
        "a sampled vocabulary-padding id (past the tokenizer) streams as the reference decodes it: "
        "no text, no error ({impl})",
        "vocab_size exceeds the tokenizer (262144 vs 255035): one sampled padding id ends the stream "
        "with an IndexError",
    ),
)
ITEM_NUMBERS = tuple(item.number for item in ITEMS)


class CouldNotRun(RuntimeError):
    """The checklist could not run at all (exit status 2): no verdict is possible."""


@dataclass
class ItemResult:
    """Verdict of one item: PASS/FAIL, one line of evidence, and per-case details for --json."""

    item: int
    title: str
    verdict: str
    evidence: str
    details: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """Everything one checklist run found."""

    implementation: str
    mlx_vlm_version: str
    live_package: Optional[str]
    fixtures: Optional[str]
    items: List[ItemResult]
    seconds: float
    error: Optional[str] = None

    @property
    def exit_code(self) -> int:
        """0 all pass, 1 any fails, 2 could not run."""
        if self.error is not None or not self.items:
            return EXIT_COULD_NOT_RUN
        return EXIT_PASS if all(r.verdict == PASS for r in self.items) else EXIT_FAIL

    def verdicts(self) -> Dict[str, str]:
        """Item number (as a string) -> PASS/FAIL."""
        return {str(r.item): r.verdict for r in self.items}

    def to_json(self) -> Dict[str, Any]:
        """The report as printed by ``--json``."""
        return {
            "implementation": self.implementation,
            "mlx_vlm_version": self.mlx_vlm_version,
            "live_package": self.live_package,
            "fixtures": self.fixtures,
            "exit_code": self.exit_code,
            "error": self.error,
            "seconds": round(self.seconds, 1),
            "verdicts": self.verdicts(),
            "items": [asdict(r) for r in self.items],
        }

    def table(self, width: int = 110) -> str:
        """The human-readable table: item, verdict, claim and evidence."""
        lines = [
            f"compass-compat pin-bump checklist: mlx-vlm {self.mlx_vlm_version}, implementation {self.implementation}",
            f"  package: {self.live_package or '-'}",
            f"  fixtures: {self.fixtures or '-'}",
        ]
        if self.error is not None:
            lines.append(f"COULD NOT RUN: {self.error}")
            lines.append("exit 2")
            return "\n".join(lines)
        lines.append("")
        lines.append(f"{'item':<5} {'verdict':<8} check / evidence")
        indent = " " * 15
        for r in self.items:
            lines.append(f"{r.item:<5} {r.verdict:<8} {r.title}")
            for part in r.evidence.split("\n"):
                lines.extend(textwrap.wrap(part, width, initial_indent=indent, subsequent_indent=indent + "  "))
        passed = sum(r.verdict == PASS for r in self.items)
        lines.append("")
        failed = ", ".join(str(r.item) for r in self.items if r.verdict != PASS)
        if self.implementation == VENDORED:
            tail = (
                "the vendored package passes every item"
                if not failed
                else f"the vendored package fails item(s) {failed}"
            )
        elif self.exit_code == EXIT_PASS:
            tail = "every item passes: the vendored copy can be deleted at this pin"
        else:
            tail = f"item(s) {failed} fail: keep the vendored copy"
        lines.append(f"{passed}/{len(self.items)} items pass; {tail} (exit {self.exit_code}) [{self.seconds:.0f}s]")
        return "\n".join(lines)


# ------------------------------------------------------------------ fixtures


def default_fixtures_dir() -> Path:
    """``<repo>/tests/fixtures`` next to this package (exists only in a source checkout)."""
    return Path(__file__).resolve().parent.parent / "tests" / "fixtures"


class Reference:
    """The recorded transformers outputs (``tests/fixtures/reference``) and their images."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.reference_dir = self.directory / "reference"
        self.images_dir = self.directory / "images"
        index = self.reference_dir / "index.json"
        if not index.is_file():
            raise CouldNotRun(
                f"reference fixtures not found: {index} does not exist. They live in the "
                "compass-compat repository checkout (tests/fixtures) and are not shipped in the "
                "wheel; run the checklist from a checkout or pass --fixtures DIR"
            )
        self.index = json.loads(index.read_text(encoding="utf-8"))
        self.cases: Dict[str, Dict[str, Any]] = dict(self.index["cases"])
        missing = [
            str(self.images_dir / name)
            for meta in self.cases.values()
            for name in meta.get("images", [])
            if not (self.images_dir / name).is_file()
        ]
        missing += [
            str(self.reference_dir / meta["file"])
            for meta in self.cases.values()
            if not (self.reference_dir / meta["file"]).is_file()
        ]
        if missing:
            raise CouldNotRun(f"reference fixtures incomplete, missing: {', '.join(missing)}")
        self._arrays: Dict[str, Dict[str, np.ndarray]] = {}

    def names(self, kind: str) -> List[str]:
        """Case names of one kind ("text" or "image"), in index order."""
        return [name for name, meta in self.cases.items() if meta["kind"] == kind]

    def image_paths(self, name: str) -> List[str]:
        """The image files of a case, in prompt order."""
        return [str(self.images_dir / image) for image in self.cases[name].get("images", [])]

    def __call__(self, name: str) -> Dict[str, np.ndarray]:
        """The arrays of one case (pixel values unpacked to [N, 3*2*16*16] float32)."""
        if name not in self._arrays:
            from safetensors.numpy import load_file

            arrays = load_file(str(self.reference_dir / self.cases[name]["file"]))
            if "pixel_values_codes" in arrays:
                arrays["pixel_values"] = _unpack_pixels(
                    arrays.pop("pixel_values_codes"), arrays.pop("pixel_values_levels")
                )
            self._arrays[name] = arrays
        return self._arrays[name]


def _unpack_pixels(codes: np.ndarray, levels: np.ndarray) -> np.ndarray:
    # Stored: the first temporal frame as per-channel uint8 indices into a table of float32 values.
    n = codes.shape[0]
    per_channel = codes.reshape(n, 3, -1).astype(np.intp)
    frame = np.stack([levels[c][per_channel[:, c]] for c in range(3)], axis=1)  # [n, 3, P*P]
    return np.repeat(frame[:, :, None, :], 2, axis=2).reshape(n, -1).astype(np.float32)


# -------------------------------------------------------------- small helpers


def _max_abs(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def _g(x: float) -> str:
    return f"{x:.2g}" if x != 0 else "0"


def _error_text(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _within(path: Optional[str], directory: Path) -> bool:
    if not path:
        return False
    real, base = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([real, base]) == base


def _token_list(tokens: Any) -> List[int]:
    return [int(t) for t in np.asarray(tokens).reshape(-1).tolist()]


def _matching_prefix(got: Sequence[int], want: Sequence[int]) -> int:
    n = 0
    for a, b in zip(got, want):
        if a != b:
            break
        n += 1
    return n


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> Tuple[int, int]:
    """Target size: sides rounded to multiples of ``factor``, area within [min, max] pixels, exact arithmetic."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return h, w


# ------------------------------------------------- the implementation under test


@dataclass
class Target:
    """The implementation under test, once made live as ``mlx_vlm.models.cohere_compass``."""

    kind: str
    available: bool
    package_dir: Optional[Path]
    mlx_vlm_version: str
    why_unavailable: str = ""


def select_implementation(kind: str) -> Target:
    """Make ``kind`` the live ``mlx_vlm.models.cohere_compass`` and say where it lives.

    upstream: the default patch (upstream wins), undoing a forced patch first (e.g.
    ``COMPASS_COMPAT_FORCE_VENDORED=1`` in the environment); vendored:
    ``apply_patch(force_vendored=True)``.
    """
    if kind not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {kind!r}")
    import compass_compat

    try:
        info = compass_compat.implementation_info()
        if kind == VENDORED:
            compass_compat.apply_patch(force_vendored=True)
        elif info.forced or not info.patched:
            compass_compat.remove_patch()
            compass_compat.apply_patch(force_vendored=False)
        info = compass_compat.implementation_info()
    except compass_compat.CompassCompatError as exc:
        raise CouldNotRun(f"could not select the {kind} cohere_compass: {exc}") from exc
    if kind == UPSTREAM and not info.upstream_available:
        return Target(
            kind,
            False,
            None,
            info.mlx_vlm_version,
            f"no upstream cohere_compass (mlx-vlm {info.mlx_vlm_version} ships none; "
            f"the first release that does is {FIRST_UPSTREAM_RELEASE})",
        )
    module = importlib.import_module(PACKAGE)
    package_dir = Path(module.__file__ or "").resolve().parent
    vendored_live = _within(module.__file__, Path(info.vendor_dir))
    if vendored_live != (kind == VENDORED):
        raise CouldNotRun(f"could not make the {kind} cohere_compass live: {PACKAGE} is {module.__file__}")
    return Target(kind, True, package_dir, info.mlx_vlm_version)


# ----------------------------------------------------------------- the context


class Context:
    """What the items share: fixtures, the implementation, built checkpoints, loaded models."""

    def __init__(self, target: Target, reference: Reference, workdir: Path):
        self.target = target
        self.reference = reference
        self.workdir = workdir
        self._checkpoints: Dict[str, Path] = {}
        self._loaded: Dict[str, Any] = {}

    # checkpoints -------------------------------------------------------
    def checkpoint(self, name: str) -> Path:
        """Tiny checkpoint folders: "original", "mlx", "small_max_pixels" (original layout)."""
        if name not in self._checkpoints:
            from .tiny import build_tiny_checkpoint

            layout = "mlx" if name == "mlx" else "original"
            variant = "small_max_pixels" if name == "small_max_pixels" else "default"
            self._checkpoints[name] = build_tiny_checkpoint(self.workdir / name, layout=layout, variant=variant)
        return self._checkpoints[name]

    def load(self, path: Path) -> Tuple[Any, Any]:
        """``mlx_vlm.load`` (model, processor), once per folder; a load error is re-raised each time."""
        key = str(path)
        if key not in self._loaded:
            try:
                from mlx_vlm import load

                model, processor = load(str(path))
            except Exception as exc:  # reported as the evidence of every item that needs it
                self._loaded[key] = exc
            else:
                self.check_model_source(model)  # CouldNotRun: no item can be attributed
                self._loaded[key] = (model, processor)
        value = self._loaded[key]
        if isinstance(value, BaseException):
            raise value
        return value

    def check_model_source(self, model: Any) -> None:
        """Raise :class:`CouldNotRun` unless ``model`` comes from the implementation under test."""
        module = sys.modules.get(type(model).__module__)
        file = getattr(module, "__file__", None)
        if self.target.package_dir is None or not _within(file, self.target.package_dir):
            raise CouldNotRun(
                f"mlx_vlm.load built {type(model).__module__}.{type(model).__name__} from {file}, "
                f"not from the {self.target.kind} package {self.target.package_dir}"
            )

    # driving a model -------------------------------------------------
    def model_inputs(self, name: str) -> Tuple[Any, Any, Dict[str, Any]]:
        """(input_ids, pixel_values or None, extra kwargs) of a reference case, as mlx arrays."""
        import mlx.core as mx

        case = self.reference(name)
        ids = mx.array(case["input_ids"])
        if "pixel_values" not in case:
            return ids, None, {}
        extra = {
            "image_grid_thw": mx.array(case["image_grid_thw"]),
            "mm_token_type_ids": mx.array(case["mm_token_type_ids"]),
        }
        return ids, mx.array(case["pixel_values"]), extra

    @staticmethod
    def prefill_logits(model: Any, ids: Any, pixel_values: Any, extra: Dict[str, Any]) -> np.ndarray:
        """Logits [L, V] of one forward pass through ``Model.__call__`` with a fresh cache."""
        cache = model.language_model.make_cache() if hasattr(model.language_model, "make_cache") else None
        out = model(ids, pixel_values, cache=cache, **extra)
        logits = getattr(out, "logits", out)
        return np.array(logits[0], dtype=np.float32)

    @staticmethod
    def greedy_ids(model: Any, ids: Any, pixel_values: Any, extra: Dict[str, Any], n: int = N_GREEDY) -> List[int]:
        """n greedy ids from mlx-vlm's own ``generate_step`` on the reference inputs."""
        from mlx_vlm.generate import generate_step

        out: List[int] = []
        for token, _ in generate_step(ids, model, pixel_values, None, max_tokens=n, temperature=0.0, **extra):
            out.append(int(token.item() if hasattr(token, "item") else token))
            if len(out) >= n:
                break
        return out

    @staticmethod
    def prompt_path(model: Any, processor: Any, prompt: str, images: List[str], n: int) -> Dict[str, Any]:
        """Run ``mlx_vlm.stream_generate`` on a prompt; return what the model was fed and the ids.

        A spy on ``model.get_input_embeddings`` records the prefill's input ids, pixel values
        and image grid: that is the processor's output as mlx-vlm hands it to the model.
        """
        from mlx_vlm import stream_generate

        fed: List[Dict[str, Any]] = []
        original = model.get_input_embeddings

        def spy(input_ids: Any = None, *args: Any, **kwargs: Any) -> Any:
            pixels = args[0] if args else kwargs.get("pixel_values")
            grid = kwargs.get("image_grid_thw")
            fed.append(
                {
                    "input_ids": np.array(input_ids),
                    "pixel_values": None if pixels is None else np.array(pixels),
                    "image_grid_thw": None if grid is None else np.array(grid),
                }
            )
            return original(input_ids, *args, **kwargs)

        model.get_input_embeddings = spy
        seen: Dict[int, int] = {}
        try:
            for result in stream_generate(
                model, processor, prompt, image=images or None, max_tokens=n, temperature=0.0
            ):
                # mlx-vlm 0.3.x yields the last token twice (again after finalizing).
                seen.setdefault(int(result.generation_tokens), int(result.token))
        finally:
            del model.get_input_embeddings
        if not fed:
            raise RuntimeError("stream_generate never called get_input_embeddings")
        return {"fed": fed[0], "tokens": [seen[k] for k in sorted(seen)]}

    def eos_id(self) -> Optional[int]:
        """The tiny checkpoint's end-of-turn id (mlx-vlm stops streaming there)."""
        config = json.loads((self.checkpoint("original") / "config.json").read_text(encoding="utf-8"))
        return config.get("eos_token_id")

    def expected_stream(self, name: str) -> List[int]:
        """Reference greedy ids as mlx-vlm streams them: up to and including an end-of-turn id."""
        want = _token_list(self.reference(name)["greedy_ids"])
        eos = self.eos_id()
        return want[: want.index(eos) + 1] if eos in want else want


# --------------------------------------------------------------------- items


def _result(
    ctx: Context, item: Item, verdict: str, evidence: str, details: Optional[Dict[str, Any]] = None
) -> ItemResult:
    return ItemResult(item.number, item.title_for(ctx.target.kind), verdict, evidence, details or {})


def _unavailable(ctx: Context, item: Item) -> Optional[ItemResult]:
    if ctx.target.available:
        return None
    return _result(ctx, item, FAIL, ctx.target.why_unavailable)


def check_ships(ctx: Context, item: Item) -> ItemResult:
    """Item 1: the implementation under test provides ``mlx_vlm.models.cohere_compass``."""
    if not ctx.target.available:
        return _result(ctx, item, FAIL, ctx.target.why_unavailable)
    where = "mlx-vlm's own" if ctx.target.kind == UPSTREAM else "the vendored (forced)"
    return _result(ctx, item, PASS, f"mlx-vlm {ctx.target.mlx_vlm_version}: {where} package {ctx.target.package_dir}")


def _case_parity(ctx: Context, name: str, model: Any, processor: Any) -> Dict[str, Any]:
    """Everything items 2 and 3 compare for one reference case."""
    case, meta = ctx.reference(name), ctx.reference.cases[name]
    ids, pixels, extra = ctx.model_inputs(name)
    want_ids = _token_list(case["input_ids"])
    want_greedy = _token_list(case["greedy_ids"])
    row: Dict[str, Any] = {"case": name, "problems": []}
    problems: List[str] = row["problems"]

    # The model on the reference inputs.
    logits = ctx.prefill_logits(model, ids, pixels, extra)
    if logits.shape != case["prefill_logits"].shape:
        row["logits_max_abs"] = None
        problems.append(f"logits shape {list(logits.shape)} vs {list(case['prefill_logits'].shape)}")
    else:
        row["logits_max_abs"] = _max_abs(logits, case["prefill_logits"])
        if not row["logits_max_abs"] <= LOGIT_TOL:
            problems.append(f"max|dlogits| {_g(row['logits_max_abs'])}")
    greedy = ctx.greedy_ids(model, ids, pixels, extra)
    row["greedy_matching"] = _matching_prefix(greedy, want_greedy)
    if greedy != want_greedy:
        problems.append(f"generate_step greedy {row['greedy_matching']}/{len(want_greedy)}")

    if pixels is not None:
        emb = model.get_input_embeddings(ids, pixels, **extra)
        positions = getattr(emb, "position_ids", None)
        if positions is None:
            row["positions_equal"] = False
            problems.append("get_input_embeddings exposes no position_ids")
        else:
            got = np.array(positions).astype(np.int64)
            row["positions_equal"] = got.shape == case["position_ids"].shape and bool(
                np.array_equal(got, case["position_ids"])
            )
            deltas = getattr(emb, "rope_deltas", None)
            row["rope_delta_equal"] = (
                deltas is not None and np.array(deltas).reshape(-1).tolist() == case["rope_deltas"].reshape(-1).tolist()
            )
            if not row["positions_equal"]:
                problems.append("position ids differ")
            elif not row["rope_delta_equal"]:
                problems.append(
                    f"rope delta {np.array(deltas).reshape(-1).tolist() if deltas is not None else None}"
                    f" vs {case['rope_deltas'].reshape(-1).tolist()}"
                )

    # The whole prompt path, as a host runs it.
    try:
        run = ctx.prompt_path(model, processor, meta["prompt"], ctx.reference.image_paths(name), N_GREEDY)
    except Exception as exc:  # the error is the evidence
        row["prompt_path_error"] = _error_text(exc)
        problems.append(f"stream_generate: {row['prompt_path_error']}")
        return row
    fed = run["fed"]
    got_ids = _token_list(fed["input_ids"])
    bos = want_ids[0]
    row["bos_count"] = _count_leading(got_ids, bos)
    row["ids_equal"] = got_ids == want_ids
    if not row["ids_equal"]:
        detail = f"{len(got_ids)} ids vs {len(want_ids)}"
        if row["bos_count"] > 1:
            detail += f", BOS x{row['bos_count']} (double BOS)"
        problems.append(f"prompt ids differ ({detail})")
    if pixels is not None:
        image_token = int(np.asarray(case["input_ids"])[np.asarray(case["mm_token_type_ids"]) == 1][0])
        row["image_tokens"] = got_ids.count(image_token)
        row["image_tokens_expected"] = int(sum(meta["num_image_tokens"]))
        if row["image_tokens"] != row["image_tokens_expected"]:
            problems.append(f"{row['image_tokens']} image tokens vs {row['image_tokens_expected']}")
        grid = fed["image_grid_thw"]
        row["grid"] = None if grid is None else np.asarray(grid).reshape(-1, 3).tolist()
        if row["grid"] != case["image_grid_thw"].tolist():
            problems.append(f"grid {row['grid']} vs {case['image_grid_thw'].tolist()}")
        got_px = fed["pixel_values"]
        if got_px is None or got_px.shape != case["pixel_values"].shape:
            row["pixels_max_abs"] = None
            problems.append(
                f"pixel_values shape {None if got_px is None else list(got_px.shape)} "
                f"vs {list(case['pixel_values'].shape)}"
            )
        else:
            row["pixels_max_abs"] = _max_abs(got_px, case["pixel_values"])
            if not row["pixels_max_abs"] <= PIXEL_TOL:
                problems.append(f"max|dpixels| {_g(row['pixels_max_abs'])}")
    want_stream = ctx.expected_stream(name)
    row["stream_matching"] = _matching_prefix(run["tokens"], want_stream)
    if run["tokens"][: len(want_stream)] != want_stream:
        problems.append(f"stream_generate greedy {row['stream_matching']}/{len(want_stream)}")
    return row


def _count_leading(ids: Sequence[int], token: int) -> int:
    n = 0
    while n < len(ids) and ids[n] == token:
        n += 1
    return n


def _summarize_cases(rows: List[Dict[str, Any]], image: bool) -> str:
    logits = [r["logits_max_abs"] for r in rows if r.get("logits_max_abs") is not None]
    parts = []
    if logits:
        parts.append(f"reference inputs: max|dlogits| {_g(max(logits))} (tol {_g(LOGIT_TOL)})")
    greedy = [r.get("greedy_matching", 0) for r in rows]
    parts.append(f"generate_step greedy {min(greedy)}/{N_GREEDY} worst")
    if image:
        parts.append(f"positions equal {sum(bool(r.get('positions_equal')) for r in rows)}/{len(rows)}")
        pixels = [r.get("pixels_max_abs") for r in rows if r.get("pixels_max_abs") is not None]
        if pixels:
            parts.append(f"prompt path: max|dpixels| {_g(max(pixels))} (tol {_g(PIXEL_TOL)})")
    ids_ok = sum(bool(r.get("ids_equal")) for r in rows)
    parts.append(f"prompt ids = reference {ids_ok}/{len(rows)}")
    stream = [r.get("stream_matching", 0) for r in rows]
    parts.append(f"stream_generate greedy {min(stream)}/{N_GREEDY} worst")
    text = "; ".join(parts)
    bad = [r for r in rows if r["problems"]]
    if bad:
        text += "\nproblems: " + "; ".join(f"{r['case']}: {', '.join(r['problems'])}" for r in bad)
    return text


def check_text(ctx: Context, item: Item) -> ItemResult:
    """Item 2: every text case, on the reference ids and through the prompt path."""
    skipped = _unavailable(ctx, item)
    if skipped:
        return skipped
    model, processor = ctx.load(ctx.checkpoint("original"))
    rows = [_case_parity(ctx, name, model, processor) for name in ctx.reference.names("text")]
    verdict = PASS if not any(r["problems"] for r in rows) else FAIL
    return _result(
        ctx, item, verdict, f"{len(rows)} text cases; " + _summarize_cases(rows, image=False), {"cases": rows}
    )


def _solid_image(path: Path, size: Tuple[int, int], colour: Tuple[int, int, int]) -> Path:
    from PIL import Image

    if not path.is_file():
        Image.new("RGB", size, colour).save(path)
    return path


def _preprocessor_probe(ctx: Context) -> Dict[str, Any]:
    """Is preprocessor_config.json honoured? Exact-arithmetic expectations from the file's values.

    The ``small_max_pixels`` checkpoint's tokenizer_config.json says min 16384 / max 65536
    pixels and its preprocessor_config.json a non-default mean/std. A solid 64x64 image must be scaled up to the min-pixel bound and
    normalise to exactly ``(v/255 - mean) / std``; the 640x480 fixture image must be scaled
    down under the max-pixel bound. The bounds are the folder's as transformers resolves them
    (``checkpoint_checks.pixel_bounds``: processor_config.json's block over this file,
    tokenizer_config.json's min/max_pixels over both), the resolution the processor and the
    checkpoint checks use.
    """
    from .checkpoint_checks import pixel_bounds

    folder = ctx.checkpoint("small_max_pixels")
    bounds = pixel_bounds(folder)
    conf = bounds.image_config
    model, processor = ctx.load(folder)
    factor = conf["patch_size"] * conf["merge_size"]
    lo, hi = bounds.min_pixels, bounds.max_pixels
    colour = (200, 120, 40)
    probes = [
        ("solid 64x64", _solid_image(ctx.workdir / "solid_64x64.png", (64, 64), colour), (64, 64)),
        ("640x480", Path(ctx.reference.images_dir / "synth_640x480.png"), (480, 640)),
    ]
    meta = ctx.reference.cases[ctx.reference.names("image")[0]]
    template = meta["prompt"]
    out: Dict[str, Any] = {
        "problems": [],
        "file": {"min_pixels": lo, "max_pixels": hi, "image_mean": conf["image_mean"], "image_std": conf["image_std"]},
    }
    for label, image, (h, w) in probes:
        th, tw = smart_resize(h, w, factor, lo, hi)
        want_grid = [1, th // conf["patch_size"], tw // conf["patch_size"]]
        try:
            fed = ctx.prompt_path(model, processor, template, [str(image)], 1)["fed"]
        except Exception as exc:  # the error is the evidence
            out["problems"].append(f"{label}: {_error_text(exc)}")
            continue
        grid = None if fed["image_grid_thw"] is None else np.asarray(fed["image_grid_thw"]).reshape(-1).tolist()
        out[label] = {"grid": grid, "expected_grid": want_grid}
        if grid != want_grid:
            out["problems"].append(f"{label}: grid {grid}, file's pixel bounds give {want_grid}")
        if label.startswith("solid") and fed["pixel_values"] is not None:
            mean = np.asarray(conf["image_mean"], np.float64)
            std = np.asarray(conf["image_std"], np.float64)
            want = (np.asarray(colour, np.float64) / 255.0 - mean) / std
            px = np.asarray(fed["pixel_values"], np.float64).reshape(
                -1, 3, conf["temporal_patch_size"], conf["patch_size"] ** 2
            )
            got = [float(px[:, c].mean()) for c in range(3)]
            err = max(float(np.max(np.abs(px[:, c] - want[c]))) for c in range(3))
            out[label].update(channel_values=got, expected=want.tolist(), max_abs=err)
            if not err <= PIXEL_TOL:
                out["problems"].append(
                    f"{label}: normalised channels {[round(v, 4) for v in got]}, the file's mean/std give "
                    f"{[round(v, 4) for v in want.tolist()]}"
                )
    return out


def check_image(ctx: Context, item: Item) -> ItemResult:
    """Item 3: every image case, plus the preprocessor_config.json probe."""
    skipped = _unavailable(ctx, item)
    if skipped:
        return skipped
    model, processor = ctx.load(ctx.checkpoint("original"))
    rows = [_case_parity(ctx, name, model, processor) for name in ctx.reference.names("image")]
    probe = _preprocessor_probe(ctx)
    ok = not any(r["problems"] for r in rows) and not probe["problems"]
    evidence = f"{len(rows)} image cases; " + _summarize_cases(rows, image=True)
    if probe["problems"]:
        evidence += "\nimage files not honoured: " + "; ".join(probe["problems"])
    else:
        evidence += (
            "\nimage files honoured (tokenizer_config.json min/max pixels, preprocessor_config.json "
            "mean/std; exact arithmetic)"
        )
    return _result(ctx, item, PASS if ok else FAIL, evidence, {"cases": rows, "preprocessor_config": probe})


def _deepstack_of(encoded: Any) -> Optional[Any]:
    if isinstance(encoded, dict):
        for key, value in encoded.items():
            if "deepstack" in str(key):
                return value
    return None


def check_cached_replay(ctx: Context, item: Item) -> ItemResult:
    """Item 4: ``encode_image`` exists and replaying its output gives the uncached logits."""
    skipped = _unavailable(ctx, item)
    if skipped:
        return skipped
    model, _ = ctx.load(ctx.checkpoint("original"))
    names = ctx.reference.names("image")
    encode = getattr(model, "encode_image", None)
    if not callable(encode):
        evidence = f"{type(model).__module__}.Model has no public encode_image"
        probe = _replay_probe_without_encode_image(ctx, model, names[0])
        return _result(ctx, item, FAIL, evidence + "\n" + probe, {"probe": probe})
    rows = []
    for name in names:
        ids, pixels, extra = ctx.model_inputs(name)
        row: Dict[str, Any] = {"case": name}
        try:
            encoded = encode(pixels, extra["image_grid_thw"])
            uncached = ctx.prefill_logits(model, ids, pixels, extra)
            replay = ctx.prefill_logits(model, ids, None, dict(extra, cached_image_features=encoded))
            row["max_abs"] = _max_abs(uncached, replay) if uncached.shape == replay.shape else float("inf")
            deepstack = _deepstack_of(encoded)
            row["deepstack_shape"] = None if deepstack is None else list(np.array(deepstack).shape)
            if hasattr(encoded, "shape") and not isinstance(encoded, dict):
                row["features_shape"] = list(encoded.shape)
        except Exception as exc:  # the error is the evidence
            row["error"] = _error_text(exc)
        rows.append(row)
    errors = [f"{r['case']}: {r['error']}" for r in rows if "error" in r]
    diffs = [r["max_abs"] for r in rows if "max_abs" in r]
    ok = not errors and all(d == 0.0 for d in diffs)
    parts = [f"encode_image + get_input_embeddings(cached_image_features=...) on {len(rows)} image cases"]
    if diffs:
        parts.append(f"max|replay - uncached logits| {_g(max(diffs))} (must be exactly 0)")
    shapes = {
        "none"
        if r["deepstack_shape"] is None
        else "[" + ", ".join([str(r["deepstack_shape"][0]), "N"] + [str(d) for d in r["deepstack_shape"][2:]]) + "]"
        for r in rows
        if "deepstack_shape" in r
    }
    arrays = {f"[N, {r['features_shape'][-1]}]" for r in rows if "features_shape" in r}
    if arrays:
        parts.append(f"encode_image returns one array {', '.join(sorted(arrays))} (deepstack in its columns)")
    else:
        parts.append(f"deepstack in encode_image's output: {', '.join(sorted(shapes)) or 'none'}")
    if errors:
        parts.append("errors: " + "; ".join(errors))
    return _result(ctx, item, PASS if ok else FAIL, "; ".join(parts), {"cases": rows})


def _replay_probe_without_encode_image(ctx: Context, model: Any, name: str) -> str:
    """Without encode_image, replay the vision tower's output through ``cached_image_features``
    the way a host would have to, and say how far the logits move (informational)."""
    ids, pixels, extra = ctx.model_inputs(name)
    try:
        tower = model.vision_tower(
            pixels.astype(model.vision_tower.patch_embed.proj.weight.dtype), extra["image_grid_thw"]
        )
        features = tower[0] if isinstance(tower, (tuple, list)) else tower
        uncached = ctx.prefill_logits(model, ids, pixels, extra)
        replay = ctx.prefill_logits(model, ids, pixels, dict(extra, cached_image_features=features))
        moved = _max_abs(uncached, replay)
        return (
            f"probe ({name}): replaying the vision tower's features via get_input_embeddings("
            f"cached_image_features=...) moves the logits by max {_g(moved)}"
            + (" (not a faithful replay)" if moved > 0 else "")
        )
    except Exception as exc:  # informational probe: its error is reported as such
        return f"probe ({name}): cached replay through get_input_embeddings failed: {_error_text(exc)}"


PROBE_HIDE_TORCH = '''
import importlib.machinery, sys
_HIDDEN = {"torch", "torchvision", "torchaudio"}
class _WithoutTorch(importlib.machinery.PathFinder):
    """The path finder, except that torch and friends are not installed."""
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            return None  # not installed: import raises ModuleNotFoundError, find_spec gives None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
    @classmethod
    def find_distributions(cls, *args, **kwargs):
        for dist in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if (dist.metadata["Name"] or "").lower() not in _HIDDEN:
                yield dist
sys.meta_path[:] = [_WithoutTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''

PROBE_SHIM = """
import compass_compat
compass_compat.apply_patch(force_vendored=True)
"""

PROBE_MODEL_CONFIG = """
import json, sys
import mlx_vlm.prompt_utils as prompt_utils
value = prompt_utils.MODEL_CONFIG.get("cohere_compass")
print("CHECKLIST-JSON " + json.dumps({
    "registered": value is not None,
    "format": None if value is None else str(getattr(value, "name", value)),
    "entries": len(prompt_utils.MODEL_CONFIG),
    "compass_compat_imported": "compass_compat" in sys.modules,
}))
"""

PROBE_PROCESSOR = """
import json, os, sys
folder, image, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
try:
    from transformers import AutoProcessor
    bare = AutoProcessor.from_pretrained(folder)
    out["bare_auto_processor"] = type(bare).__module__ + "." + type(bare).__name__
except Exception as exc:
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
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["torch_imported"] = any(m.partition(".")[0] in ("torch", "torchvision") for m in sys.modules)
out["compass_compat_imported"] = "compass_compat" in sys.modules
print("CHECKLIST-JSON " + json.dumps(out))
"""


def _run_probe(code: str, args: Sequence[str] = (), force: bool = False) -> Dict[str, Any]:
    """Run ``code`` in a fresh interpreter (cwd /, so the repo is not on sys.path) and parse its JSON."""
    # No COMPASS_COMPAT_* switch leaks in (e.g. COMPASS_COMPAT_AUTOPATCH=1 would import the
    # shim at interpreter start and spoil the pristine upstream probes).
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPASS_COMPAT_")}
    if force:
        env["COMPASS_COMPAT_FORCE_VENDORED"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        cwd="/",
        env=env,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("CHECKLIST-JSON "):
            return json.loads(line[len("CHECKLIST-JSON ") :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"probe exited {proc.returncode}: " + " | ".join(tail)}


def check_model_config(ctx: Context, item: Item) -> ItemResult:
    """Item 5: the pristine MODEL_CONFIG (upstream: an interpreter that never imports compass_compat)."""
    vendored = ctx.target.kind == VENDORED
    out = _run_probe((PROBE_SHIM if vendored else "") + PROBE_MODEL_CONFIG)
    if "error" in out:
        return _result(ctx, item, FAIL, out["error"], out)
    source = "after import compass_compat (forced)" if vendored else "pristine, compass_compat not imported"
    if out["compass_compat_imported"] and not vendored:
        return _result(ctx, item, FAIL, "the probe imported compass_compat; not pristine", out)
    if out["registered"]:
        return _result(ctx, item, PASS, f"MODEL_CONFIG['cohere_compass'] = {out['format']} ({source})", out)
    return _result(
        ctx, item, FAIL, f"MODEL_CONFIG has no 'cohere_compass' among its {out['entries']} entries ({source})", out
    )


def check_processor_without_torch(ctx: Context, item: Item) -> ItemResult:
    """Item 6: with torch hidden, mlx_vlm.load and AutoProcessor build the implementation's processor."""
    skipped = _unavailable(ctx, item)
    if skipped:
        return skipped
    vendored = ctx.target.kind == VENDORED
    name = ctx.reference.names("image")[0]
    code = PROBE_HIDE_TORCH + (PROBE_SHIM if vendored else "") + PROBE_PROCESSOR
    out = _run_probe(
        code,
        [str(ctx.checkpoint("original")), ctx.reference.image_paths(name)[0], ctx.reference.cases[name]["prompt"]],
        force=vendored,
    )
    problems = []
    if "error" in out:
        problems.append(out["error"])
    package_dir = ctx.target.package_dir
    for key in ("load_processor", "auto_processor"):
        if key in out and not _within(out.get(key + "_file"), package_dir):
            problems.append(
                f"{key.replace('_', ' ')} built {out[key]} ({out.get(key + '_file')}), "
                f"not the {ctx.target.kind} processor"
            )
    if out.get("torch_imported"):
        problems.append("torch was imported")
    if out.get("compass_compat_imported") and not vendored:
        problems.append("the probe imported compass_compat")
    if problems:
        return _result(ctx, item, FAIL, "torch hidden: " + "; ".join(problems), out)
    note = ""
    if not vendored:
        bare = " ".join(str(out.get("bare_auto_processor")).split()).split(". ")[0]
        note = f"\n(info: AutoProcessor called before mlx-vlm imports the package gives {bare})"
    return _result(
        ctx,
        item,
        PASS,
        f"torch hidden: mlx_vlm.load, and AutoProcessor after the package import, give "
        f"{out['auto_processor']}; {name} -> pixel_values {out.get('pixel_values_shape')}; "
        f"torch never imported" + note,
        out,
    )


def _vendored_sources() -> List[Tuple[str, Path]]:
    from ._patch import vendor_root

    root = vendor_root()
    out = []
    for path in sorted((root / "mlx_vlm").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _external_imports() -> List[Tuple[str, str, List[str]]]:
    """(importing module, imported module, names) for every import of mlx_lm / mlx_vlm /
    transformers in the vendored tree, relative imports resolved; the package's own modules skipped."""
    found = []
    for module_name, path in _vendored_sources():
        is_package = path.name == "__init__.py"
        package = module_name if is_package else module_name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    found.append((module_name, alias.name, []))
                continue
            else:
                continue
            found.append((module_name, target, names))
    keep = []
    for importer, target, names in found:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            continue  # the vendored package itself: covered by importing it
        if target.partition(".")[0] in ("mlx_lm", "mlx_vlm", "transformers"):
            keep.append((importer, target, names))
    return keep


def _import_side_by_side() -> ModuleType:
    """Import the vendored package a second time as ``SIDE_BY_SIDE`` (relative imports still reach
    the installed mlx-vlm: the name sits under mlx_vlm.models)."""
    from ._patch import vendor_root

    if SIDE_BY_SIDE in sys.modules:
        return sys.modules[SIDE_BY_SIDE]
    pkg_dir = vendor_root() / "mlx_vlm" / "models" / MODEL_TYPE
    spec = importlib.util.spec_from_file_location(
        SIDE_BY_SIDE, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"no import spec for {pkg_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[SIDE_BY_SIDE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == SIDE_BY_SIDE or n.startswith(SIDE_BY_SIDE + ".")]:
            del sys.modules[name]
        raise
    return module


def _rope_reference_error() -> float:
    """max |initialize_rope(...)(x) - rotate-half RoPE computed in numpy| as the vendored code calls it."""
    import mlx.core as mx
    from mlx_lm.models.rope_utils import initialize_rope

    head_dim, theta, offset = 16, 50000.0, 5
    rope = initialize_rope(head_dim, base=theta, traditional=False)
    x = np.random.default_rng(0).standard_normal((1, 2, 7, head_dim)).astype(np.float32)
    got = np.array(rope(mx.array(x), offset=offset))
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(offset, offset + 7, dtype=np.float64)[:, None] * inv
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    half = head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return _max_abs(got, x * cos + rotated * sin)


def check_vendored_imports(ctx: Context, item: Item) -> ItemResult:
    """Item 7: every mlx-lm / mlx-vlm / transformers name the vendored code imports resolves here,
    initialize_rope computes rotate-half RoPE, and the package imports side by side."""
    resolved, missing = [], []
    for importer, target, names in _external_imports():
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # the error is the evidence
            missing.append(f"{target} (imported by {importer}): {_error_text(exc, 120)}")
            continue
        for name in names:
            if not hasattr(module, name) and importlib.util.find_spec(f"{target}.{name}") is None:
                missing.append(f"{target}.{name} (imported by {importer})")
            else:
                resolved.append(f"{target}.{name}")
        if not names:
            resolved.append(target)
    details: Dict[str, Any] = {"resolved": sorted(set(resolved)), "missing": missing}
    rope = "initialize_rope: not checked"
    try:
        err = _rope_reference_error()
        details["initialize_rope_max_abs"] = err
        rope = f"initialize_rope = numpy rotate-half RoPE to {_g(err)}"
        if not err <= 1e-5:
            missing.append(f"mlx_lm initialize_rope(non-traditional) is not rotate-half RoPE (max|d| {_g(err)})")
    except Exception as exc:  # the error is the evidence
        missing.append(f"initialize_rope: {_error_text(exc, 160)}")
    try:
        module = _import_side_by_side()
        side = f"vendored package imports side by side as {module.__name__}"
    except Exception as exc:  # the error is the evidence
        missing.append(f"importing the vendored package: {_error_text(exc, 200)}")
        side = ""
    rotary = [r for r in sorted(set(resolved)) if "rope" in r]
    evidence = (
        f"{len(set(resolved))} names resolve ({', '.join(rotary) or 'no rotary helper imported'}; {rope}); {side}"
    )
    if missing:
        return _result(ctx, item, FAIL, "missing: " + "; ".join(missing), details)
    return _result(ctx, item, PASS, evidence, details)


def _quantize_checkpoint(ctx: Context) -> Tuple[Path, Path, int]:
    """Quantize the tiny MLX-layout checkpoint in-process (4-bit, group 64, affine) and save it.

    The float model is loaded through the implementation under test (``mlx_vlm.utils.load_model``,
    as ``mlx_vlm convert`` would) and quantized with ``mlx.nn.quantize``; layers whose input
    dimension is not a multiple of 64 (the tiny vision tower's 32-wide blocks and position
    table) stay float, which is what the predicate says. Also saves its float "twin": the same
    checkpoint with every quantized weight dequantized, i.e. exactly what the quantized model
    must compute. Returns (quantized folder, twin folder, number of quantized modules written).
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    source = ctx.checkpoint("mlx")
    model = load_model(source)
    ctx.check_model_source(model)

    def fits(path: str, module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return hasattr(module, "to_quantized") and weight is not None and weight.shape[-1] % QUANT_GROUP == 0

    nn.quantize(model, group_size=QUANT_GROUP, bits=QUANT_BITS, class_predicate=fits)
    weights = dict(tree_flatten(model.parameters()))
    prefixes = [key[: -len(".scales")] for key in weights if key.endswith(".scales")]
    twin = dict(weights)
    for prefix in prefixes:
        twin[prefix + ".weight"] = mx.dequantize(
            twin[prefix + ".weight"],
            twin.pop(prefix + ".scales"),
            twin.pop(prefix + ".biases"),
            group_size=QUANT_GROUP,
            bits=QUANT_BITS,
        )
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    folders = (ctx.workdir / "quantized", ctx.workdir / "dequantized_twin")
    for folder, tensors, quantization in ((folders[0], weights, True), (folders[1], twin, False)):
        folder.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.name not in ("model.safetensors", "config.json"):
                shutil.copyfile(path, folder / path.name)
        mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "mlx"})
        conf = dict(config)
        if quantization:
            conf["quantization"] = {"group_size": QUANT_GROUP, "bits": QUANT_BITS, "mode": "affine"}
        (folder / "config.json").write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")
    return folders[0], folders[1], len(prefixes)


def check_quantized(ctx: Context, item: Item) -> ItemResult:
    """Item 8: quantize, reload with mlx_vlm.load, compare with the dequantized twin, generate."""
    skipped = _unavailable(ctx, item)
    if skipped:
        return skipped
    import mlx.nn as nn

    folder, twin_folder, written = _quantize_checkpoint(ctx)
    model, processor = ctx.load(folder)
    twin, _ = ctx.load(twin_folder)
    quantized = sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    details: Dict[str, Any] = {"quantized_modules_written": written, "quantized_modules_loaded": quantized, "cases": {}}
    problems = []
    if quantized != written or written == 0:
        problems.append(f"{quantized} quantized modules loaded, {written} written")
    parts = []
    for name in (ctx.reference.names("text")[0], ctx.reference.names("image")[0]):
        case = ctx.reference(name)
        ids, pixels, extra = ctx.model_inputs(name)
        row: Dict[str, Any] = {}
        try:
            logits = ctx.prefill_logits(model, ids, pixels, extra)
            row["twin_max_abs"] = _max_abs(logits, ctx.prefill_logits(twin, ids, pixels, extra))
            row["reference_top1_agreement"] = float(np.mean(logits.argmax(-1) == case["prefill_logits"].argmax(-1)))
            run = ctx.prompt_path(
                model, processor, ctx.reference.cases[name]["prompt"], ctx.reference.image_paths(name), N_GREEDY
            )
            row["generated"] = len(run["tokens"])
            if not (len(run["tokens"]) == N_GREEDY or (run["tokens"] and run["tokens"][-1] == ctx.eos_id())):
                problems.append(f"{name}: stream_generate gave {len(run['tokens'])} tokens")
            if not row["twin_max_abs"] <= QUANT_TWIN_TOL:
                problems.append(
                    f"{name}: quantized logits differ from the dequantized twin's by "
                    f"{_g(row['twin_max_abs'])} (tol {_g(QUANT_TWIN_TOL)})"
                )
            parts.append(
                f"{name}: max|quantized - dequantized twin| {_g(row['twin_max_abs'])}, "
                f"{row['generated']} tokens generated (top-1 = float reference at "
                f"{row['reference_top1_agreement']:.0%} of positions)"
            )
        except Exception as exc:  # the error is the evidence
            row["error"] = _error_text(exc)
            problems.append(f"{name}: {row['error']}")
        details["cases"][name] = row
    head = (
        f"4-bit group-64 affine, quantized with mlx.nn.quantize: {quantized}/{written} quantized "
        f"modules reloaded; " + "; ".join(parts)
    )
    if problems:
        return _result(ctx, item, FAIL, head + "\nproblems: " + "; ".join(problems), details)
    return _result(ctx, item, PASS, head + f" (tol {_g(QUANT_TWIN_TOL)})", details)


def check_layouts(ctx: Context, item: Item) -> ItemResult:
    """Item 9: both weight layouts load (strictly) and give the reference logits."""
    skipped = _unavailable(ctx, item)
    if skipped:
        return skipped
    details: Dict[str, Any] = {}
    parts, problems = [], []
    cases = (ctx.reference.names("text")[0], ctx.reference.names("image")[0])
    for layout in ("original", "mlx"):
        try:
            model, _ = ctx.load(ctx.checkpoint(layout))
            diffs = {}
            for name in cases:
                ids, pixels, extra = ctx.model_inputs(name)
                diffs[name] = _max_abs(
                    ctx.prefill_logits(model, ids, pixels, extra), ctx.reference(name)["prefill_logits"]
                )
            details[layout] = diffs
            worst = max(diffs.values())
            parts.append(f"{layout}: max|dlogits| {_g(worst)} on {', '.join(cases)}")
            if not worst <= LOGIT_TOL:
                problems.append(f"{layout} logits off by {_g(worst)}")
        except Exception as exc:  # the error is the evidence
            details[layout] = {"error": _error_text(exc)}
            problems.append(f"{layout}: {_error_text(exc)}")
    evidence = "; ".join(parts)
    if problems:
        return _result(
            ctx, item, FAIL, (evidence + "\n" if evidence else "") + "problems: " + "; ".join(problems), details
        )
    return _result(ctx, item, PASS, evidence + f" (tol {_g(LOGIT_TOL)})", details)


def check_padding_ids(ctx: Context, item: Item) -> ItemResult:
    """Item 10: the detokenizer ``mlx_vlm.load`` attaches streams padding ids as the reference's
    ``decode`` does: the text is that of the same ids without them."""
    skipped = _unavailable(ctx, item)
    if skipped:
        return skipped
    try:
        model, processor = ctx.load(ctx.checkpoint("original"))
        tokenizer = getattr(processor, "tokenizer", processor)
        size, vocab = len(tokenizer), int(model.config.text_config.vocab_size)
        if vocab <= size:
            raise CouldNotRun(f"the tiny checkpoint has no padding rows (vocab_size {vocab}, tokenizer {size})")
        words = tokenizer("the picture shows a red square", add_special_tokens=False)["input_ids"]
        padded = words[:2] + [size, vocab - 1] + words[2:]
        reference = tokenizer.decode(padded)
        if reference != tokenizer.decode(words):  # the reference's own rule, re-checked on this pin
            raise CouldNotRun(f"this transformers decodes padding ids to text: {reference!r}")

        def stream(ids: List[int]) -> str:
            detokenizer = processor.detokenizer
            detokenizer.reset()
            for token in ids:
                detokenizer.add_token(token)
            detokenizer.finalize()
            return detokenizer.text

        want = stream(words)
        try:
            got = stream(padded)
        except Exception as exc:  # the error is the evidence
            return _result(
                ctx,
                item,
                FAIL,
                f"streaming ids {padded}: {_error_text(exc)}",
                {"ids": padded, "error": _error_text(exc)},
            )
    except CouldNotRun:
        raise
    except Exception as exc:  # loading or tokenizing failed: the error is the evidence
        return _result(ctx, item, FAIL, _error_text(exc), {"error": _error_text(exc)})
    details = {
        "ids": padded,
        "tokenizer_size": size,
        "vocab_size": vocab,
        "text": got,
        "expected": want,
        "reference_decode": reference,
        "detokenizer": type(processor.detokenizer).__name__,
    }
    evidence = (
        f"{type(processor.detokenizer).__name__} on ids {padded} (padding ids {size} and {vocab - 1}; "
        f"tokenizer {size}, vocab_size {vocab}): {got!r}"
    )
    if got != want:
        return _result(ctx, item, FAIL, evidence + f", without the padding ids {want!r}", details)
    return _result(ctx, item, PASS, evidence + ", the same as without them (reference decode: nothing)", details)


CHECKS: Dict[int, Callable[[Context, Item], ItemResult]] = {
    1: check_ships,
    2: check_text,
    3: check_image,
    4: check_cached_replay,
    5: check_model_config,
    6: check_processor_without_torch,
    7: check_vendored_imports,
    8: check_quantized,
    9: check_layouts,
    10: check_padding_ids,
}


# ------------------------------------------------------------------- running


def _check_fixture_weights(reference: Reference) -> None:
    from .tiny import tiny_weights, weights_sha256

    recorded = reference.index.get("checkpoint", {})
    want = recorded.get("weights_sha256")
    got = weights_sha256(tiny_weights(int(recorded.get("seed", 0))))
    if want != got:
        raise CouldNotRun(
            f"the reference fixtures were recorded from other tiny weights (sha256 {want}, this "
            f"compass_compat builds {got}); re-record them with scripts/record_reference.py"
        )


def run_checklist(
    implementation: str = UPSTREAM,
    items: Optional[Sequence[int]] = None,
    fixtures: Optional[Path] = None,
) -> Report:
    """Run the checklist items (all by default) against ``implementation``.

    Args:
        implementation: ``"upstream"`` (mlx-vlm's own cohere_compass) or ``"vendored"``.
        items: item numbers to run (default: all nine).
        fixtures: the directory holding ``reference/`` and ``images/`` (default: the
            repository's ``tests/fixtures`` next to this package).

    Returns:
        A :class:`Report`; ``report.exit_code`` is 0/1/2 as the command's. A failure to run at
        all (missing fixtures, the implementation cannot be made live) is reported with
        ``error`` set, never raised.
    """
    start = time.monotonic()
    wanted = list(ITEM_NUMBERS if items is None else items)
    unknown = sorted(set(wanted) - set(ITEM_NUMBERS))
    if unknown:
        raise ValueError(f"unknown checklist item(s) {unknown}; items are {list(ITEM_NUMBERS)}")
    fixtures_dir = Path(fixtures) if fixtures is not None else default_fixtures_dir()
    version, live = "unknown", None
    try:
        from ._patch import _mlx_vlm_version

        version = _mlx_vlm_version()
        reference = Reference(fixtures_dir)
        _check_fixture_weights(reference)
        target = select_implementation(implementation)
        live = str(target.package_dir) if target.package_dir else None
        results = []
        with tempfile.TemporaryDirectory(prefix="compass-checklist-") as tmp:
            ctx = Context(target, reference, Path(tmp))
            for item in ITEMS:
                if item.number not in wanted:
                    continue
                try:
                    results.append(CHECKS[item.number](ctx, item))
                except CouldNotRun:
                    raise
                except Exception as exc:  # an item that crashes FAILS, with the error as its evidence
                    results.append(_result(ctx, item, FAIL, _error_text(exc, 600)))
    except CouldNotRun as exc:
        return Report(implementation, version, live, str(fixtures_dir), [], time.monotonic() - start, str(exc))
    return Report(implementation, version, live, str(fixtures_dir), results, time.monotonic() - start)


def _parse_items(text: str) -> List[int]:
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--items takes comma-separated item numbers, got {text!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: print the table (or JSON) and return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m compass_compat.checklist",
        description="Check, at the installed mlx-vlm pin, every item that must hold before the "
        "vendored cohere_compass can be deleted (CHECKLIST.md). Exit 0: all pass; "
        "1: some fail; 2: could not run.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--implementation",
        choices=IMPLEMENTATIONS,
        default=UPSTREAM,
        help="check mlx-vlm's own package (default) or the vendored one",
    )
    parser.add_argument(
        "--items", type=_parse_items, default=None, help="comma-separated item numbers to run (default: all)"
    )
    parser.add_argument(
        "--fixtures",
        type=Path,
        default=None,
        help="directory with reference/ and images/ (default: <repo>/tests/fixtures)",
    )
    args = parser.parse_args(argv)
    try:
        report = run_checklist(args.implementation, args.items, args.fixtures)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(report.table())
    if report.error is not None and not args.json:
        print(f"could not run: {report.error}", file=sys.stderr)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
