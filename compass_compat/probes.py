"""Probes of the running install: what it can do, measured once per process instead of assumed
from version numbers (what each measures: docs/testing.md)."""

from __future__ import annotations

import functools
import json
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional


@dataclass(frozen=True)
class Probe:
    """One measurement: ``ok`` True (works), False (broken), None (not observable); what was seen."""

    ok: Optional[bool]
    evidence: str

    @property
    def broken(self) -> bool:
        """Only a measured failure counts; an unobservable probe refuses nothing."""
        return self.ok is False


class _Stop(Exception):
    """Raised by the spy to stop the loader at its quantize call."""


@functools.lru_cache(maxsize=None)
def loader_passes_mode(mode: str, group_size: int, bits: int) -> Probe:
    """Whether mlx-vlm's ``load_model`` hands the checkpoint's quantization mode to ``mlx.nn.quantize``."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_vlm.utils as utils

    from compass_data.tiny import tiny_config

    loader = utils.load_model
    while getattr(loader, "__compass_compat__", False) and hasattr(loader, "__wrapped__"):
        loader = loader.__wrapped__  # compass-compat's guard would validate (and probe) again
    name = f"mlx_vlm.utils.load_model (mode {mode})"
    seen: Dict[str, Any] = {}
    me = threading.get_ident()
    real = nn.quantize

    def spy(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != me:  # another thread's quantize is not ours to stop
            return real(*args, **kwargs)
        seen.update(kwargs)
        seen["called"] = True
        raise _Stop

    with tempfile.TemporaryDirectory(prefix="compass-probe-") as tmp:
        folder = Path(tmp)
        config = {**tiny_config(), "quantization": {"group_size": group_size, "bits": bits, "mode": mode}}
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
        mx.save_safetensors(str(folder / "model.safetensors"), {}, metadata={"format": "mlx"})
        nn.quantize = spy
        try:
            loader(folder)
        except _Stop:
            pass
        except Exception as exc:
            if not seen:
                return Probe(
                    None, f"{name} failed before quantizing ({type(exc).__name__}: {str(exc)[:200]}); not observed"
                )
        finally:
            nn.quantize = real
    if not seen:
        return Probe(None, f"{name} never called mlx.nn.quantize (the hook looked for); not observed")
    got = seen.get("mode", "<no mode keyword>")
    ok = got == mode
    return Probe(
        ok,
        f"{name} called mlx.nn.quantize with mode={got!r}"
        + ("" if ok else f", so the {mode} weights meet {'affine' if got == '<no mode keyword>' else got} layers"),
    )
