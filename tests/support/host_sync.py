"""A guard that fails (or counts) on every host synchronisation of MLX arrays inside a block:
what a decode step must not do. tests/test_no_host_sync.py checks the decode step with it and
shows it catches each kind of sync; scripts/bench/fullsize.py counts with it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class HostSyncError(AssertionError):
    """A device array was read back to the host (or evaluated) inside a guarded region."""


# Methods of mx.array that evaluate the array and hand its data to Python.
ARRAY_METHODS = (
    "item",
    "tolist",
    "__array__",
    "__int__",
    "__float__",
    "__bool__",
    "__index__",
    "__repr__",
    "__str__",
    "__format__",
    "__dlpack__",
    "__getstate__",
)
# numpy entry points that copy a device array to the host (np.array uses the buffer protocol,
# which no Python attribute of mx.array controls, so it is caught here).
NUMPY_FUNCS = ("array", "asarray", "asanyarray", "ascontiguousarray", "copy", "frombuffer")
# Explicit evaluation: mx.eval blocks until the graph is computed.
MX_FUNCS = ("eval",)


def _has_mx_array(value) -> bool:
    if isinstance(value, mx.array):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_mx_array(v) for v in value)
    if isinstance(value, dict):
        return any(_has_mx_array(v) for v in value.values())
    return False


class HostSyncGuard:
    """Context manager: raise (or count) on host synchronisation of MLX arrays.

    ``mode="raise"`` raises :class:`HostSyncError` at the offending call; ``mode="count"``
    records ``(name, count)`` in ``self.calls`` and lets the call through. Everything patched
    is restored on exit.
    """

    def __init__(self, mode: str = "raise"):
        if mode not in ("raise", "count"):
            raise ValueError(f"mode must be 'raise' or 'count', got {mode!r}")
        self.mode = mode
        self.calls = {}
        self._saved = []

    def _hit(self, name: str, original):
        def wrapper(*args, **kwargs):
            if name.startswith("np.") and not (_has_mx_array(args) or _has_mx_array(kwargs)):
                return original(*args, **kwargs)
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.mode == "raise":
                raise HostSyncError(f"host synchronisation inside a decode step: {name}")
            return original(*args, **kwargs)

        return wrapper

    def _patch(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        self._saved.append((owner, attr, original))
        setattr(owner, attr, self._hit(label, original))

    def __enter__(self):
        for attr in ARRAY_METHODS:
            if hasattr(mx.array, attr):
                self._patch(mx.array, attr, f"mx.array.{attr}")
        for attr in NUMPY_FUNCS:
            self._patch(np, attr, f"np.{attr}")
        for attr in MX_FUNCS:
            self._patch(mx, attr, f"mx.{attr}")
        return self

    def __exit__(self, *exc):
        while self._saved:
            owner, attr, original = self._saved.pop()
            setattr(owner, attr, original)
        return False
