"""In-process probe for the host end-to-end runs (scripts/hosts/common/e2e.py).

The runs put this folder on the host's PYTHONPATH, so Python imports this module at startup
in the host's processes (after the .pth files, so after compass-compat's opt-in hook). It
does nothing unless COMPASS_HOST_PROBE_DIR names a folder. Then a daemon thread waits until
the host itself has imported ``mlx_vlm.models.cohere_compass`` (it never imports mlx-vlm or the
model itself, so the host's import order and threads stay the host's) and writes
``probe-<pid>.json`` there: which file that package was loaded from and
``compass_compat.implementation_info()``, asked inside the host's process. Once the package is
live it also counts, by wrapping the classes' methods (the host's code is not touched): every
``VisionFeatureCache.get`` (hit or miss) and ``put`` (mlx-vlm's class or a host's vendored copy),
with the entry count after each put, and every run of the vision tower (``Model.encode_image``,
with the pictures' grids). After every counted call it writes ``probe-<pid>-vision.json`` (hosts
may end without running atexit), at a clean exit ``probe-<pid>-exit.json``: those counts and the
entry count of every ``VisionFeatureCache`` still alive. Counts, not the exit size, are the
evidence: a host may clear its cache on shutdown (LM Studio's engine does). With
COMPASS_HOST_PROBE_TRACE=1 it also logs every ``LanguageModel`` call (``probe-<pid>-lm.jsonl``).
"""

import os

_DIR = os.environ.get("COMPASS_HOST_PROBE_DIR")
_PACKAGE = "mlx_vlm.models.cohere_compass"


def _watch(out_dir):
    import json
    import sys
    import time

    pid = os.getpid()
    record = {"pid": pid, "argv": sys.argv[:6], "compass_compat_loaded_by_host": False}
    while _PACKAGE not in sys.modules or getattr(sys.modules[_PACKAGE], "__file__", None) is None:
        time.sleep(0.2)
    time.sleep(0.5)  # let the host's import of the package finish
    record["compass_compat_loaded_by_host"] = "compass_compat" in sys.modules
    record["live_file"] = getattr(sys.modules[_PACKAGE], "__file__", None)
    try:
        import compass_compat

        info = compass_compat.implementation_info()
        record["compass_compat_file"] = compass_compat.__file__
        record["info"] = {
            k: (str(v) if v is not None and not isinstance(v, (bool, int, float, str)) else v)
            for k, v in vars(info).items()
        }
    except Exception as err:  # reported, never raised into the host
        record["error"] = f"{type(err).__name__}: {err}"
    try:
        _count_vision_work(sys.modules[_PACKAGE])
    except Exception as err:  # reported, never raised into the host
        record["counting_error"] = f"{type(err).__name__}: {err}"
    path = os.path.join(out_dir, f"probe-{pid}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    os.replace(path + ".tmp", path)
    implementation = record.get("info", {}).get("implementation", record.get("error"))
    print(
        f"[compass-host-probe] pid {pid}: cohere_compass live = {implementation} ({record['live_file']})",
        file=sys.stderr,
        flush=True,
    )


_COUNTS = {"cache_get_hit": 0, "cache_get_miss": 0, "cache_put": 0, "entries_after_put": [], "tower_runs": []}


_WRAPPED = set()


def _cache_classes():
    """Every loaded VisionFeatureCache class (mlx-vlm's, or a host's vendored copy)."""
    import sys

    found = []
    for name, module in list(sys.modules.items()):
        kind = getattr(module, "VisionFeatureCache", None) if name.endswith("vision_cache") else None
        if isinstance(kind, type) and kind not in found:
            found.append(kind)
    return found


def _dump_counts():
    """probe-<pid>-vision.json after every counted call: hosts that end without atexit still leave it."""
    import json

    path = os.path.join(_DIR, f"probe-{os.getpid()}-vision.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), **_COUNTS}, f)
    os.replace(path + ".tmp", path)


def _count_vision_work(package):
    """Wrap VisionFeatureCache.get/put and the live Model.encode_image to count calls."""
    import threading
    import time

    def grids(value):
        try:
            rows = value.tolist() if hasattr(value, "tolist") else value
            return [list(map(int, row)) for row in rows] if rows is not None else None
        except (TypeError, ValueError, AttributeError, RuntimeError):  # a value logged as it is
            return "?"

    model_cls = package.Model
    encode = model_cls.encode_image

    def counted_encode(self, pixel_values, image_grid_thw=None, *args, **kwargs):
        _COUNTS["tower_runs"].append(grids(image_grid_thw))
        _dump_counts()
        return encode(self, pixel_values, image_grid_thw, *args, **kwargs)

    model_cls.encode_image = counted_encode

    def wrap(kind):
        get, put = kind.get, kind.put

        def counted_get(self, key):
            hit = get(self, key)
            _COUNTS["cache_get_hit" if hit is not None else "cache_get_miss"] += 1
            _dump_counts()
            return hit

        def counted_put(self, key, features):
            put(self, key, features)
            _COUNTS["cache_put"] += 1
            _COUNTS["entries_after_put"].append(len(self))
            _dump_counts()

        kind.get, kind.put = counted_get, counted_put

    def wrap_cache():
        # mlx-vlm's class, and copies of it a host vendors (Rapid-MLX:
        # rapid_mlx.models.mlx_vlm_vendored.vision_cache); some import it late, or never.
        while True:
            for kind in _cache_classes():
                if kind not in _WRAPPED:
                    _WRAPPED.add(kind)
                    wrap(kind)
            time.sleep(1.0)

    threading.Thread(target=wrap_cache, name="compass-host-probe-cache", daemon=True).start()
    if os.environ.get("COMPASS_HOST_PROBE_TRACE"):
        _trace_language_model(package)


def _trace_language_model(package):
    """COMPASS_HOST_PROBE_TRACE=1: one line per LanguageModel call (what the host passes, what
    delta the model has to go on) in probe-<pid>-lm.jsonl, for tracing a wrong answer."""
    import json
    import sys

    lm_cls = package.LanguageModel
    call = lm_cls.__call__
    stored = getattr(sys.modules.get(package.__name__ + ".positions"), "KEPT", "compass_positions")
    path = os.path.join(_DIR, f"probe-{os.getpid()}-lm.jsonl")

    def rows(value):
        try:
            return value.reshape(-1).tolist() if value is not None else None
        except (TypeError, ValueError, AttributeError, RuntimeError):  # a value logged as its type
            return repr(type(value))

    def traced(self, inputs=None, inputs_embeds=None, mask=None, cache=None, **kwargs):
        first = cache[0] if cache else None
        offset = getattr(first, "offset", None)
        given = kwargs.get("position_ids")
        visual = kwargs.get("visual_pos_masks")
        line = {
            "B_L": list((inputs_embeds if inputs_embeds is not None else inputs).shape[:2]),
            "cache": type(first).__name__ if first is not None else None,
            "cache_id": id(first) if first is not None else None,
            "offset": rows(offset) if hasattr(offset, "reshape") else offset,
            "kwargs": sorted(k for k, v in kwargs.items() if v is not None),
            "rope_deltas": rows(kwargs.get("rope_deltas")),
            "position_ids_shape": list(given.shape) if given is not None else None,
            # the temporal axis's last column per row: a decode step's positions
            "position_ids_last": rows(given[0, :, -1]) if given is not None and given.ndim == 3 else None,
            "stored_delta_on_cache": rows(getattr(getattr(first, stored, None), "delta", None)),
            "module_rope_deltas": rows(self._rope_deltas),
            "position_rows": rows(kwargs.get("position_rows")),
            # a decode step's input ids, one per row (the tokens each row was fed)
            "ids": rows(inputs) if inputs is not None and inputs.shape[-1] == 1 else None,
            # per row: vision tokens in this forward's slice of visual_pos_masks, and whether
            # its last column is one (a prefill cut inside a picture)
            "visual_tokens": rows(visual.sum(axis=-1)) if visual is not None and visual.ndim == 2 else None,
            "visual_last": rows(visual[:, -1]) if visual is not None and visual.ndim == 2 else None,
        }
        try:
            out = call(self, inputs, inputs_embeds, mask, cache, **kwargs)
        except Exception as err:
            line["error"] = f"{type(err).__name__}: {err}"
            raise
        finally:
            line["stored_delta_after"] = rows(getattr(getattr(first, stored, None), "delta", None))
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        return out

    lm_cls.__call__ = traced


def _at_exit(out_dir):
    import gc
    import json
    import sys

    if _PACKAGE not in sys.modules:
        return
    kinds = tuple(_cache_classes())
    sizes = [len(obj) for obj in gc.get_objects() if isinstance(obj, kinds)] if kinds else []
    with open(os.path.join(out_dir, f"probe-{os.getpid()}-exit.json"), "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "vision_feature_cache_entries": sizes, **_COUNTS}, f)


if _DIR:
    import atexit
    import threading

    os.makedirs(_DIR, exist_ok=True)
    atexit.register(_at_exit, _DIR)
    threading.Thread(target=_watch, args=(_DIR,), name="compass-host-probe", daemon=True).start()
