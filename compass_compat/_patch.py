"""The one module that patches mlx-vlm for ``cohere_compass``: :func:`apply_patch` looks up every
hook first, then installs, all or nothing, what ARCHITECTURE.md's table "What the shim installs"
lists (docs/shim.md says why each is needed)."""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

from . import verdicts
from .errors import CompassCompatError
from .vendor import MODEL_TYPE, PACKAGE, is_vendored, package_dir, vendor_root, within

PROCESSING_MODULE = f"{PACKAGE}.processing_{MODEL_TYPE}"
VIDEO_MODULE = f"{PACKAGE}.video_processing_{MODEL_TYPE}"
PROCESSOR_CLASS = "CohereCompassProcessor"
IMPLEMENTATION_ENV = "COMPASS_COMPAT_IMPLEMENTATION"
SWITCH_VALUES = ("auto", "vendored", "upstream")
FORCE_ENV = "COMPASS_COMPAT_FORCE_VENDORED"  # =1: IMPLEMENTATION=vendored, kept as an alias
MLX_LM_ENV = "COMPASS_COMPAT_MLX_LM"
MLX_LM_PACKAGE = f"mlx_lm.models.{MODEL_TYPE}"
TAG = "__compass_compat__"
MLX_BUILDS = (
    "install an MLX build: on Linux without a GPU pip install 'compass-compat[cpu]' (from a checkout: "
    "pip install '.[cpu]'), with CUDA 12 '[cuda]' instead ('[cuda13]' for CUDA 13); on macOS plain pip install has Metal"
)

# Older mlx-vlm releases are refused by name (README, "Supported mlx-vlm pins"); the tested ones are pins.sh's.
OLDEST_SUPPORTED = (0, 4)
OLDEST_TESTED = "0.4.4"
TESTED_RELEASES = "0.4.4, 0.6.3, 0.6.12, 0.7.10"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_MISSING = object()
_UNREADABLE = object()
_VIDEO_ITEM_TYPES = ("video", "video_url", "input_video")

_Undo = Callable[[], None]


@dataclass
class _State:
    applied: bool = False
    forced: bool = False  # the vendored package made live over (or instead of) upstream's
    force_source: str = ""
    switch: str = "auto"
    switch_source: str = ""
    verdict: Optional[verdicts.Verdict] = None  # the record's word where mlx-vlm ships its own
    processor_hook: bool = False
    mlx_lm: bool = False
    undo: List[_Undo] = field(default_factory=list)


_LOCK = threading.Lock()
_STATE = _State()


@dataclass(frozen=True)
class ImplementationInfo:
    """Which ``cohere_compass`` implementation mlx-vlm gets, and why (docs/shim.md)."""

    implementation: str  # "vendored", "upstream" or "none"
    file: Optional[str]  # the live (or, not yet imported, the resolvable) package's __init__.py
    loaded: bool  # mlx_vlm.models.cohere_compass is in sys.modules
    patched: bool
    forced: bool  # the vendored package made live over upstream's
    upstream_available: bool  # the installed mlx-vlm ships its own package
    mlx_vlm_version: str
    vendor_dir: str
    reason: str  # one sentence: why this implementation is the live one
    switch: str = "auto"  # COMPASS_COMPAT_IMPLEMENTATION as applied
    verdict: str = ""  # the recorded verdict on the installed mlx-vlm's own package; "" where it ships none


def _mlx_vlm_version() -> str:
    import mlx_vlm

    return str(mlx_vlm.__version__)


def _refuse_unsupported(version: str) -> None:
    """Refuse an mlx-vlm older than :data:`OLDEST_SUPPORTED` by name, before any hook is looked up."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and (int(match[1]), int(match[2])) < OLDEST_SUPPORTED:
        raise CompassCompatError(
            f"compass-compat does not support mlx-vlm {version}: it supports mlx-vlm "
            f"{'.'.join(map(str, OLDEST_SUPPORTED))} and later (tested: {TESTED_RELEASES}); "
            f"upgrade with pip install 'mlx-vlm>={OLDEST_TESTED}'; mlx-vlm was left unchanged",
            mlx_vlm_version=version,
        )


def _flag_from_env(name: str) -> Tuple[bool, str]:
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True, f"environment variable {name}={raw}"
    if value in _FALSE:
        return False, ""
    raise CompassCompatError(f"{name}={raw!r} is neither true (1/true/yes/on) nor false (0/false/no/off/empty)")


def _switch(implementation: Optional[str], force_vendored: Optional[bool]) -> Tuple[str, str]:
    """The switch's value (auto, vendored, upstream) and where it came from."""
    if implementation is not None:
        value, source = str(implementation).strip().lower(), f"apply_patch(implementation={implementation!r})"
    elif force_vendored is not None:
        value = "vendored" if force_vendored else "auto"
        source = f"apply_patch(force_vendored={force_vendored})"
    else:
        raw = os.environ.get(IMPLEMENTATION_ENV, "")
        value, source = (raw.strip().lower() or "auto"), (f"{IMPLEMENTATION_ENV}={raw}" if raw.strip() else "")
        forced, force_source = _flag_from_env(FORCE_ENV)
        if forced and value == "upstream":
            raise CompassCompatError(
                f"{FORCE_ENV}=1 asks for the vendored cohere_compass and {IMPLEMENTATION_ENV}={raw} for "
                f"upstream's: unset one of them"
            )
        if forced:
            value, source = "vendored", force_source
    if value not in SWITCH_VALUES:
        raise CompassCompatError(
            f"{source or IMPLEMENTATION_ENV} is not one of {', '.join(SWITCH_VALUES)} (which cohere_compass is "
            "live: auto follows the checklist's recorded verdicts; vendored is compass-compat's; upstream is "
            "mlx-vlm's own, 0.6.13 and later)"
        )
    return value, source


@dataclass
class _Hooks:
    """Everything apply_patch touches, looked up before anything changes."""

    version: str
    vendor: Path
    mlx_vlm: Any
    models: Any
    model_config: Any
    image_first: Any
    auto_processor: Any
    mlx_lm_models: Any = None


def _find_hooks(mlx_lm: bool = False) -> _Hooks:
    """Look up every hook; raise naming all missing ones. Changes nothing."""
    try:
        import mlx.core  # noqa: F401  (on Linux plain ``mlx`` has no backend: libmlx.so is missing)
    except (ImportError, OSError) as err:
        raise CompassCompatError(f"mlx cannot load here ({type(err).__name__}: {err}): {MLX_BUILDS}") from err
    import mlx_vlm

    version = _mlx_vlm_version()
    _refuse_unsupported(version)
    import transformers

    missing: List[str] = []

    def need(owner: Any, owner_name: str, attr: str, check: Callable[[Any], bool] = callable) -> Any:
        if owner is None:
            return None  # the owner itself is already reported missing
        value = getattr(owner, attr, _MISSING)
        if value is _MISSING or not check(value):
            missing.append(f"{owner_name}.{attr}")
            return None
        return value

    def is_path(p: Any) -> bool:
        return hasattr(p, "append")

    # The modules are on every supported pin (mlx-lm is a dependency of mlx-vlm); what moves between releases
    # is what they hold.
    models = importlib.import_module("mlx_vlm.models")
    need(models, "mlx_vlm.models", "__path__", is_path)
    prompt_utils = importlib.import_module("mlx_vlm.prompt_utils")
    model_config = need(prompt_utils, "mlx_vlm.prompt_utils", "MODEL_CONFIG", lambda d: isinstance(d, dict))
    message_format = need(prompt_utils, "mlx_vlm.prompt_utils", "MessageFormat", lambda v: True)
    # LIST_WITH_IMAGE_FIRST: on every mlx-vlm from 0.4.4 to 0.7.10 (qwen3_vl uses it).
    image_first = need(message_format, "mlx_vlm.prompt_utils.MessageFormat", "LIST_WITH_IMAGE_FIRST", lambda v: True)
    auto_processor = need(transformers, "transformers", "AutoProcessor", lambda v: True)
    need(auto_processor, "transformers.AutoProcessor", "from_pretrained")
    lm_models = importlib.import_module("mlx_lm.models") if mlx_lm else None
    need(lm_models, "mlx_lm.models", "__path__", is_path)
    if missing:
        raise CompassCompatError(
            f"compass-compat cannot patch mlx-vlm {version}: missing hook(s) "
            f"{', '.join(missing)}; mlx-vlm was left unchanged",
            hooks=missing,
            mlx_vlm_version=version,
        )
    return _Hooks(version, vendor_root(), mlx_vlm, models, model_config, image_first, auto_processor, lm_models)


def _upstream_spec(models: Any, vendor: Path) -> Optional[importlib.machinery.ModuleSpec]:
    """Upstream's own cohere_compass spec (mlx-vlm >= 0.6.13), ignoring the vendored path entry."""
    ours = os.path.realpath(vendor / "mlx_vlm" / "models")
    entries = [p for p in list(getattr(models, "__path__", [])) if os.path.realpath(p) != ours]
    return importlib.machinery.PathFinder.find_spec(PACKAGE, entries)


def _wrap(owner: Any, attr: str, hook: Callable[..., Any], undo: List[_Undo]) -> bool:
    """Install ``hook(original, *args, **kwargs)`` in place of ``owner.attr`` (a function or a
    classmethod of ``owner`` itself), tagged, never twice. Undone, it passes every call through,
    and is removed while it is still the installed one (a later wrapper keeps it as an inert link)."""
    original = vars(owner).get(attr, _MISSING)
    is_classmethod = isinstance(original, classmethod)
    function = original.__func__ if is_classmethod else original
    if original is _MISSING or not callable(function) or getattr(function, TAG, False):
        return False
    active = [True]

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if active[0]:
            return hook(function, *args, **kwargs)
        return function(*args, **kwargs)

    setattr(wrapper, TAG, True)
    wrapper.__compass_compat_original__ = original  # type: ignore[attr-defined]
    installed = classmethod(wrapper) if is_classmethod else wrapper
    setattr(owner, attr, installed)

    def restore() -> None:
        active[0] = False
        if vars(owner).get(attr) is installed:
            setattr(owner, attr, original)

    undo.append(restore)
    return True


def _append_path(owner: Any, entry: Path, undo: List[_Undo]) -> None:
    text = str(entry)
    if any(os.path.realpath(p) == os.path.realpath(text) for p in list(owner.__path__)):
        return
    owner.__path__.append(text)

    def remove() -> None:
        if text in owner.__path__:
            owner.__path__.remove(text)

    undo.append(remove)


def _package_modules() -> List[str]:
    return [n for n in list(sys.modules) if n == PACKAGE or n.startswith(PACKAGE + ".")]


def _make_vendored_live(hooks: _Hooks, undo: List[_Undo]) -> None:
    """Purge any other cohere_compass from sys.modules and import ours under its name."""
    if is_vendored(sys.modules.get(PACKAGE)):
        return
    saved = {name: sys.modules[name] for name in _package_modules()}
    parent = hooks.models
    old_attr = vars(parent).get(MODEL_TYPE, _MISSING)

    def restore() -> None:
        for name in _package_modules():
            del sys.modules[name]
        sys.modules.update(saved)
        if old_attr is _MISSING:
            vars(parent).pop(MODEL_TYPE, None)
        else:
            setattr(parent, MODEL_TYPE, old_attr)

    undo.append(restore)
    for name in saved:
        del sys.modules[name]
    # An explicit spec keeps the name, so the package's relative imports (..base, ..cache)
    # reach the installed mlx-vlm.
    pkg_dir = package_dir()
    spec = importlib.util.spec_from_file_location(
        PACKAGE, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    setattr(parent, MODEL_TYPE, module)


def _register_message_format(hooks: _Hooks, overwrite: bool, undo: List[_Undo]) -> None:
    table = hooks.model_config  # mutated in place: other modules imported it by name
    previous = table.get(MODEL_TYPE, _MISSING)
    if previous is hooks.image_first or (previous is not _MISSING and not overwrite):
        return
    table[MODEL_TYPE] = hooks.image_first

    def restore() -> None:
        if previous is _MISSING:
            table.pop(MODEL_TYPE, None)
        else:
            table[MODEL_TYPE] = previous

    undo.append(restore)


def _local_config(path: Any) -> Any:
    """config.json of a local folder: the parsed value, None if absent, or _UNREADABLE."""
    try:
        with open(os.path.join(os.fspath(path), "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, ValueError):
        return _UNREADABLE
    except (TypeError, OSError):
        return None


def _says_compass(data: Any) -> bool:
    return isinstance(data, dict) and str(data.get("model_type", "")).lower() == MODEL_TYPE


def is_compass_checkpoint(path: Any) -> bool:
    """True when ``path`` is a local folder whose config.json says ``cohere_compass``."""
    return _says_compass(_local_config(path))


def _install_processor_hook(hooks: _Hooks, undo: List[_Undo]) -> None:
    """A local cohere_compass folder gets the vendored torch-free processor, checked first
    (on ``AutoProcessor.from_pretrained`` itself, which every pin has)."""
    from . import checkpoint_checks

    def from_pretrained(original: Callable[..., Any], cls: type, path: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_compass_checkpoint(path):
            return original(cls, path, *args, **kwargs)
        processor_cls = getattr(importlib.import_module(PROCESSING_MODULE), PROCESSOR_CLASS)
        checkpoint_checks.validate_checkpoint(path)
        return _refusing(path, processor_cls.from_pretrained, path, *args, **kwargs)

    _wrap(hooks.auto_processor, "from_pretrained", from_pretrained, undo)


@functools.lru_cache(maxsize=None)
def _float32_class(base: type) -> type:
    import mlx.core as mx
    import mlx.nn as nn

    name = "as_linear" if issubclass(base, nn.QuantizedEmbedding) else "__call__"
    method = getattr(base, name)

    def call(self: Any, x: Any) -> Any:
        if x.dtype not in (mx.bfloat16, mx.float16):
            return method(self, x)
        return method(self, x.astype(mx.float32)).astype(x.dtype)

    return type(base.__name__, (base,), {name: call, "__module__": __name__})


def _fp_modes_in_float32(model: Any) -> Any:
    """On the CPU, the decoder's fp-mode (mxfp4 / mxfp8 / nvfp4) quantized layers take float32
    activations, in place; elsewhere, and for affine layers, nothing changes."""
    import mlx.core as mx
    import mlx.nn as nn

    if mx.default_device() != mx.cpu:
        return model
    # MLX's CPU fp-mode quantized_matmul is ~1% off with bfloat16 inputs: without this the logits
    # are 0.52-0.68 off the dequantized weights' (tests/test_quant_modes.py), with it 0.
    for _, layer in model.language_model.named_modules():
        quantized = isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        if quantized and getattr(layer, "mode", "affine") != "affine" and type(layer).__module__ != __name__:
            layer.__class__ = _float32_class(type(layer))
    return model


def _refusing(folder: Any, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, a library's refusal of ``folder`` raised as one CheckpointError line."""
    from .checkpoint_checks import refusal

    try:
        return call(*args, **kwargs)
    except Exception as err:
        refused = refusal(folder, err)
        if refused is None:
            raise
        raise refused from err


def _install_loader_guard(undo: List[_Undo]) -> None:
    """``validate_checkpoint`` before mlx-vlm's loader reads the folder, the loader's own refusals as
    one line; on the CPU the fp-mode float32 rule on what it loaded."""
    from . import checkpoint_checks

    def load_model(original: Callable[..., Any], model_path: Any, *args: Any, **kwargs: Any) -> Any:
        config = _local_config(model_path)
        if config is _UNREADABLE or _says_compass(config):  # the refusal names an unreadable config.json
            checkpoint_checks.validate_checkpoint(model_path)
            return _fp_modes_in_float32(_refusing(model_path, original, model_path, *args, **kwargs))
        return original(model_path, *args, **kwargs)

    _wrap(importlib.import_module("mlx_vlm.utils"), "load_model", load_model, undo)


def _is_video_item(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") in _VIDEO_ITEM_TYPES


def _install_video_prompt_hook(undo: List[_Undo]) -> None:
    """A cohere_compass user turn with videos gets one video part per video after its images
    (mlx-vlm formats video only for the models it names)."""
    formatter = importlib.import_module("mlx_vlm.prompt_utils").MessageFormatter

    def format_message(original: Callable[..., Any], self: Any, prompt: Any, role: str = "user", *args, **kwargs):
        videos = kwargs.get("video")
        explicit = [item for item in prompt if _is_video_item(item)] if isinstance(prompt, list) else []
        if getattr(self, "model_name", None) != MODEL_TYPE or role != "user" or not (videos or explicit):
            return original(self, prompt, role, *args, **kwargs)
        count = len(explicit) if explicit else (len(videos) if isinstance(videos, (list, tuple)) else 1)
        rest = {k: v for k, v in kwargs.items() if k not in ("video", "fps", "max_pixels")}
        if explicit:
            prompt = [item for item in prompt if not _is_video_item(item)]
        message = original(self, prompt, role, *args, **rest)
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            return message
        content = list(message["content"])
        at = 0
        while at < len(content) and isinstance(content[at], dict) and content[at].get("type") == "image":
            at += 1
        content[at:at] = [{"type": "video"} for _ in range(count)]
        return {**message, "content": content}

    _wrap(formatter, "format_message", format_message, undo)


def _install_video_file_hook(undo: List[_Undo]) -> None:
    """mlx-vlm 0.6.x's ``load_video`` (no ``frame_sampler``): its frames remembered with their
    file and rate, so the processor reads that file's frames by the reference's rule."""
    utils = importlib.import_module("mlx_vlm.utils")
    original = vars(utils).get("load_video")
    if not callable(original):
        return  # mlx-vlm 0.4.x decodes no video files
    parameters = inspect.signature(original).parameters
    if "frame_sampler" in parameters:
        return  # mlx-vlm 0.7.x asks the processor's sample_frames itself
    from .video_files import DECODED_VIDEOS

    fps_default = parameters["fps"].default

    def registry() -> Any:
        # Looked up when a file is decoded, not at patch time: the package is imported lazily.
        importlib.import_module(VIDEO_MODULE).CohereCompassVideoProcessor.reread_decoded = DECODED_VIDEOS.reread
        return DECODED_VIDEOS

    def load_video(original: Callable[..., Any], video_path: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(video_path, *args, **kwargs)
        requested = kwargs.get("fps", args[0] if args else fps_default)
        if (
            isinstance(result, tuple)
            and result
            and kwargs.get("nframes") is None
            and is_vendored(sys.modules.get(PACKAGE))
        ):
            registry().remember(result[0], str(video_path), requested)
        return result

    def forget_reader() -> None:
        processor = getattr(sys.modules.get(VIDEO_MODULE), "CohereCompassVideoProcessor", None)
        if processor is not None and hasattr(processor, "reread_decoded"):
            processor.reread_decoded = None

    undo.append(forget_reader)
    _wrap(utils, "load_video", load_video, undo)


def _run_undo(steps: List[_Undo]) -> None:
    while steps:
        steps.pop()()


def apply_patch(
    implementation: Optional[str] = None,
    mlx_lm: Optional[bool] = None,
    *,
    force_vendored: Optional[bool] = None,
) -> bool:
    """Patch the installed mlx-vlm so it can load ``cohere_compass`` checkpoints; True if this call
    changed anything. The switch and its rule: docs/shim.md, "Upstream or vendored".

    Args:
        implementation: ``"auto"``, ``"vendored"`` or ``"upstream"``; None reads
            ``COMPASS_COMPAT_IMPLEMENTATION`` (or ``COMPASS_COMPAT_FORCE_VENDORED=1``, an alias of vendored).
        mlx_lm: also register the vendored text decoder with mlx-lm; None reads ``COMPASS_COMPAT_MLX_LM``.
        force_vendored: the older form of ``implementation="vendored"`` (False: auto).

    Raises:
        CompassCompatError: naming what to fix; mlx-vlm is left as this call found it.
    """
    switch, source = _switch(implementation, force_vendored)
    lm = _flag_from_env(MLX_LM_ENV)[0] if mlx_lm is None else bool(mlx_lm)
    with _LOCK:
        hooks = _find_hooks(mlx_lm=lm)
        upstream = _upstream_spec(hooks.models, hooks.vendor) is not None
        live, verdict = verdicts.live_for(hooks.version, upstream)
        if switch == "upstream" and not upstream:
            raise CompassCompatError(
                f"{source} asks for mlx-vlm's own cohere_compass, but mlx-vlm {hooks.version} ships none "
                "(the first release that does is 0.6.13): use auto or vendored",
                mlx_vlm_version=hooks.version,
            )
        vendored = (live if switch == "auto" else switch) == "vendored"
        # Made live now where upstream ships one (or the switch asks); elsewhere it resolves
        # through the appended path entry when mlx-vlm imports it.
        force = vendored and (upstream or switch == "vendored")
        if _STATE.applied:
            if _STATE.forced and not force:
                raise CompassCompatError(
                    f"{source} asks for mlx-vlm's own cohere_compass, but the vendored package is already live "
                    f"({_STATE.force_source}); call compass_compat.remove_patch() first",
                    mlx_vlm_version=hooks.version,
                )
            if (_STATE.forced or not force) and (_STATE.mlx_lm or not lm):
                return False
        if lm and not (vendored or _STATE.forced):
            raise CompassCompatError(
                f"compass-compat cannot register cohere_compass with mlx-lm: mlx-vlm {hooks.version}'s own "
                f"cohere_compass is live ({source}), and the mlx-lm model reuses the vendored decoder; "
                f"set {IMPLEMENTATION_ENV}=vendored (or apply_patch('vendored', mlx_lm=True))",
                hooks=[f"{MLX_LM_PACKAGE} (needs the vendored {PACKAGE})"],
                mlx_vlm_version=hooks.version,
            )
        steps: List[_Undo] = []
        try:
            _append_path(hooks.mlx_vlm, hooks.vendor / "mlx_vlm", steps)
            _append_path(hooks.models, hooks.vendor / "mlx_vlm" / "models", steps)
            if force:
                _make_vendored_live(hooks, steps)
            _register_message_format(hooks, overwrite=force, undo=steps)
            if vendored:  # upstream's package, where live, registers its own processor
                if not _STATE.processor_hook:
                    _install_processor_hook(hooks, steps)
                _install_loader_guard(steps)
                _install_video_prompt_hook(steps)
                _install_video_file_hook(steps)
            if lm:  # mlx-lm 0.28 to 0.32 ship no cohere_compass; one that does wins (end of path)
                _append_path(hooks.mlx_lm_models, hooks.vendor / "mlx_lm" / "models", steps)
        except BaseException:
            _run_undo(steps)
            raise
        first = not _STATE.applied
        _STATE.undo.extend(steps)
        _STATE.applied = True
        _STATE.forced = _STATE.forced or force
        _STATE.force_source = _STATE.force_source or (source or "the recorded verdicts" if force else "")
        _STATE.switch, _STATE.switch_source, _STATE.verdict = switch, source, verdict
        _STATE.processor_hook = _STATE.processor_hook or vendored
        _STATE.mlx_lm = _STATE.mlx_lm or lm
    if first:
        _log_choice()
    return True


@functools.lru_cache(maxsize=None)
def _log_choice() -> None:
    """One INFO line per process naming the live cohere_compass and why."""
    info = implementation_info()
    logging.getLogger("compass_compat").info("cohere_compass: %s live (%s)", info.implementation, info.reason)


def remove_patch() -> bool:
    """Undo :func:`apply_patch` (meant for tests and pin-bump checks): every hook restored, the
    upstream modules a forced apply purged put back, the vendored modules dropped from
    ``sys.modules``. Returns False if nothing was applied."""
    with _LOCK:
        if not _STATE.applied:
            return False
        steps = _STATE.undo
        _STATE.__init__()  # type: ignore[misc]
        _run_undo(steps)
        root = vendor_root()
        for name, module in list(sys.modules.items()):
            if name.startswith(("mlx_vlm.", "mlx_lm.")) and within(getattr(module, "__file__", None), root):
                del sys.modules[name]
                parent_name, _, child = name.rpartition(".")
                parent = sys.modules.get(parent_name)
                if parent is not None and vars(parent).get(child) is module:
                    delattr(parent, child)
        return True


def implementation_info() -> ImplementationInfo:
    """Report which ``cohere_compass`` implementation mlx-vlm gets, and why."""
    import mlx_vlm.models as models

    with _LOCK:
        version = _mlx_vlm_version()
        root = vendor_root()
        upstream = _upstream_spec(models, root) is not None
        live = sys.modules.get(PACKAGE)
        if live is not None:
            file = getattr(live, "__file__", None)
        else:
            spec = importlib.machinery.PathFinder.find_spec(PACKAGE, list(getattr(models, "__path__", [])))
            file = spec.origin if spec is not None else None
        kind = "none" if file is None else ("vendored" if within(file, root) else "upstream")
        applied, forced = _STATE.applied, _STATE.forced
        switch, switch_source, verdict = _STATE.switch, _STATE.switch_source, _STATE.verdict
    if verdict is None and upstream:
        verdict = verdicts.upstream_verdict(version)  # not applied yet: what auto would go by
    said = verdict.describe() if verdict is not None else ""
    asked = switch_source or f"{IMPLEMENTATION_ENV}={switch}"
    if kind == "vendored" and forced and switch == "vendored":
        reason = f"{asked} asks for the vendored package" + (
            f"; it replaces the cohere_compass mlx-vlm {version} ships" if upstream else ""
        )
    elif kind == "vendored" and forced:
        reason = f"{said}: the vendored package replaces it ({IMPLEMENTATION_ENV}=auto, the default)"
    elif kind == "vendored":
        reason = (
            f"mlx-vlm {version} ships no cohere_compass; the vendored package resolves "
            "through the directory appended to mlx_vlm.models.__path__"
        )
    elif kind == "upstream" and applied and switch == "upstream":
        reason = f"mlx-vlm {version}'s own cohere_compass, as {asked} asks ({said})"
    elif kind == "upstream" and applied:
        reason = f"mlx-vlm {version}'s own cohere_compass: {said}"
    elif kind == "upstream":
        reason = f"mlx-vlm {version}'s own cohere_compass (compass-compat is not applied)"
    else:
        reason = f"mlx-vlm {version} ships no cohere_compass and compass-compat is not applied"
    return ImplementationInfo(
        implementation=kind,
        file=file,
        loaded=live is not None,
        patched=applied,
        forced=forced,
        upstream_available=upstream,
        mlx_vlm_version=version,
        vendor_dir=str(root),
        reason=reason,
        switch=switch,
        verdict=said,
    )
