"""generate's sampling flags, and the values the installed mlx-vlm fills in for those left out."""

from __future__ import annotations

import argparse
import importlib
import inspect
from typing import Callable, Dict, Optional

from .. import implementation_info
from .common import bounded

SAMPLING_FLAGS = ("temperature", "top_p", "top_k")

# Measured per pin (tests/test_generation_config.py); releases between 0.6.12 and 0.7.10 unchecked.
_UNSET_SAMPLING = (
    "as the installed mlx-vlm's generate: mlx-vlm 0.7.10 takes the checkpoint's generation_config.json "
    "(greedy if it says do_sample false), else temperature 0, top-p 1, top-k 0; mlx-vlm 0.6.12 and older "
    "use those fixed defaults; --verbose prints the values used"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--temperature, --top-p, --top-k (unset by default: see :func:`sampling_settings`) and --seed."""
    parser.add_argument(
        "--temperature",
        type=bounded(float, 0.0),
        metavar="T",
        help=f"sampling temperature, 0 is greedy; default: {_UNSET_SAMPLING}",
    )
    parser.add_argument(
        "--top-p",
        type=bounded(float, 0.0, 1.0),
        metavar="P",
        help="nucleus sampling, 1 disables it; default: as --temperature",
    )
    parser.add_argument(
        "--top-k",
        type=bounded(int, 0),
        metavar="K",
        help="sample from the K most likely tokens, 0 disables it; default: as --temperature",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="PRNG seed for sampling, set just before generating, so a run repeats (default: %(default)s)",
    )


def _sampling_resolver() -> Optional[Callable]:
    """mlx-vlm's own resolution of unset sampling options, where it has one (0.7.10; not 0.6.12)."""
    try:
        from mlx_vlm.generate.common import resolve_sampling_defaults
    except ImportError:
        return None
    return resolve_sampling_defaults


def unset_sampling_follows_checkpoint() -> bool:
    """Whether this mlx-vlm's generate fills unset sampling options from generation_config.json."""
    return _sampling_resolver() is not None


def _generate_step_defaults() -> Dict[str, float]:
    """The sampling keywords this mlx-vlm's generate_step takes, with their defaults."""
    generate = importlib.import_module("mlx_vlm.generate")  # a module to 0.4.x, a package from 0.5
    params = inspect.signature(generate.generate_step).parameters
    return {name: params[name].default for name in SAMPLING_FLAGS if name in params}


def given_sampling(args: argparse.Namespace) -> Dict[str, float]:
    """The sampling flags the user passed (as stream_generate keywords)."""
    return {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}


def sampling_settings(config, given: Dict[str, float]) -> Dict[str, float]:
    """What stream_generate samples with on this mlx-vlm: ``given``, the rest as mlx-vlm fills them in.

    mlx-vlm 0.7.10 takes unset values from the checkpoint's generation config (load puts
    generation_config.json's keys on the model config), else 0.0 / 1.0 / 0, greedy when
    do_sample is false. mlx-vlm <= 0.6.12 uses generate_step's defaults; 0.6.x load keeps the
    file's keys on the config too, but only its server reads them.
    """
    resolve = _sampling_resolver()
    if resolve is not None:
        return dict(zip(SAMPLING_FLAGS, resolve(config, **{name: given.get(name) for name in SAMPLING_FLAGS})))
    return {name: given.get(name, default) for name, default in _generate_step_defaults().items()}


def describe_sampling(settings: Dict[str, float], seed: int) -> str:
    """The ``Sampling:`` line's text: the values used, the seed, and where unset values came from."""
    values = " ".join(f"{name}={value:g}" for name, value in settings.items())
    version = implementation_info().mlx_vlm_version
    if unset_sampling_follows_checkpoint():
        source = f"unset: the checkpoint's generation_config.json, else mlx-vlm {version}'s defaults"
    else:
        source = f"unset: mlx-vlm {version}'s generate defaults, which ignore generation_config.json's sampling keys"
    return f"{values} seed={seed} ({source})"
