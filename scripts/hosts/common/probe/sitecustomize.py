"""In-process probe for the host runs (scripts/hosts/common/e2e.py) and the server tests.

On the host's PYTHONPATH it is imported at startup (after compass-compat's .pth hook) and does
nothing unless COMPASS_HOST_PROBE_DIR names a folder. Then, once the host itself has imported
``mlx_vlm.models.cohere_compass``, it writes ``probe-<pid>.json`` there (the live file and
``compass_compat.implementation_info()`` inside the host's process) and counts, by wrapping
the classes' methods, every ``Model.encode_image`` and ``VisionFeatureCache`` get / put
(``probe-<pid>-vision.json`` after each, ``probe-<pid>-exit.json`` at a clean exit, with the
entries of every cache alive). COMPASS_HOST_PROBE_TRACE=1 also logs every ``LanguageModel`` call
(``probe-<pid>-lm.jsonl``).
"""

import os

_DIR = os.environ.get("COMPASS_HOST_PROBE_DIR")
_PACKAGE = "mlx_vlm.models.cohere_compass"
_COUNTS = {"cache_get_hit": 0, "cache_get_miss": 0, "cache_put": 0, "entries_after_put": [], "tower_runs": []}
_WRAPPED = set()


def _write_json(name, record):
    import json

    path = os.path.join(_DIR, name)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    os.replace(path + ".tmp", path)


def _watch():
    import sys
    import time

    pid = os.getpid()
    # The host's import order and threads stay the host's: wait for its import of the package.
    while _PACKAGE not in sys.modules or getattr(sys.modules[_PACKAGE], "__file__", None) is None:
        time.sleep(0.2)
    time.sleep(0.5)  # let the host's import of the package finish
    record = {"pid": pid, "argv": sys.argv[:6], "compass_compat_loaded_by_host": "compass_compat" in sys.modules}
    record["live_file"] = sys.modules[_PACKAGE].__file__
    try:
        import compass_compat

        record["compass_compat_file"] = compass_compat.__file__
        record["info"] = {
            k: (str(v) if v is not None and not isinstance(v, (bool, int, float, str)) else v)
            for k, v in vars(compass_compat.implementation_info()).items()
        }
    except Exception as err:  # reported, never raised into the host
        record["error"] = f"{type(err).__name__}: {err}"
    try:
        _count_vision_work(sys.modules[_PACKAGE])
    except Exception as err:  # reported, never raised into the host
        record["counting_error"] = f"{type(err).__name__}: {err}"
    _write_json(f"probe-{pid}.json", record)
    implementation = record.get("info", {}).get("implementation", record.get("error"))
    live = f"cohere_compass live = {implementation} ({record['live_file']})"
    print(f"[compass-host-probe] pid {pid}: {live}", file=sys.stderr, flush=True)


def _cache_classes():
    """Every loaded VisionFeatureCache class (mlx-vlm's, or a host's vendored copy)."""
    import sys

    found = []
    for name, module in list(sys.modules.items()):
        kind = getattr(module, "VisionFeatureCache", None) if name.endswith("vision_cache") else None
        if isinstance(kind, type) and kind not in found:
            found.append(kind)
    return found


def _counted():
    # After every counted call: hosts that end without atexit still leave the counts.
    _write_json(f"probe-{os.getpid()}-vision.json", {"pid": os.getpid(), **_COUNTS})


def _count_vision_work(package):
    import threading
    import time

    def grids(value):
        try:
            rows = value.tolist() if hasattr(value, "tolist") else value
            return [list(map(int, row)) for row in rows] if rows is not None else None
        except (TypeError, ValueError, AttributeError, RuntimeError):
            return "?"

    encode = package.Model.encode_image

    def counted_encode(self, pixel_values, image_grid_thw=None, *args, **kwargs):
        _COUNTS["tower_runs"].append(grids(image_grid_thw))
        _counted()
        return encode(self, pixel_values, image_grid_thw, *args, **kwargs)

    package.Model.encode_image = counted_encode

    def wrap(kind):
        get, put = kind.get, kind.put

        def counted_get(self, key):
            hit = get(self, key)
            _COUNTS["cache_get_hit" if hit is not None else "cache_get_miss"] += 1
            _counted()
            return hit

        def counted_put(self, key, features):
            put(self, key, features)
            _COUNTS["cache_put"] += 1
            _COUNTS["entries_after_put"].append(len(self))
            _counted()

        kind.get, kind.put = counted_get, counted_put

    def wrap_caches():
        # Hosts import their cache class late or never (Rapid-MLX vendors a copy): keep looking.
        while True:
            for kind in _cache_classes():
                if kind not in _WRAPPED:
                    _WRAPPED.add(kind)
                    wrap(kind)
            time.sleep(1.0)

    threading.Thread(target=wrap_caches, name="compass-host-probe-cache", daemon=True).start()
    if os.environ.get("COMPASS_HOST_PROBE_TRACE"):
        _trace_language_model(package)


def _trace_language_model(package):
    """One line per LanguageModel call: what the host passes and the delta the model has on hand."""
    import json
    import sys

    call = package.LanguageModel.__call__
    stored = getattr(sys.modules.get(package.__name__ + ".positions"), "KEPT", "compass_positions")
    path = os.path.join(_DIR, f"probe-{os.getpid()}-lm.jsonl")

    def rows(value):
        try:
            return value.reshape(-1).tolist() if value is not None else None
        except (TypeError, ValueError, AttributeError, RuntimeError):
            return repr(type(value))

    def traced(self, inputs=None, inputs_embeds=None, mask=None, cache=None, **kwargs):
        first = cache[0] if cache else None
        offset = getattr(first, "offset", None)
        given = kwargs.get("position_ids")
        visual = kwargs.get("visual_pos_masks")
        two_d = visual is not None and visual.ndim == 2
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
            "ids": rows(inputs) if inputs is not None and inputs.shape[-1] == 1 else None,  # a decode step's
            # per row: vision tokens in this slice, and whether its last column is one (a cut inside a picture)
            "visual_tokens": rows(visual.sum(axis=-1)) if two_d else None,
            "visual_last": rows(visual[:, -1]) if two_d else None,
        }
        try:
            return call(self, inputs, inputs_embeds, mask, cache, **kwargs)
        except Exception as err:
            line["error"] = f"{type(err).__name__}: {err}"
            raise
        finally:
            line["stored_delta_after"] = rows(getattr(getattr(first, stored, None), "delta", None))
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")

    package.LanguageModel.__call__ = traced


def _at_exit():
    import gc
    import json
    import sys

    if _PACKAGE not in sys.modules:
        return
    kinds = tuple(_cache_classes())
    sizes = [len(obj) for obj in gc.get_objects() if isinstance(obj, kinds)] if kinds else []
    with open(os.path.join(_DIR, f"probe-{os.getpid()}-exit.json"), "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "vision_feature_cache_entries": sizes, **_COUNTS}, f)


if _DIR:
    import atexit
    import threading

    os.makedirs(_DIR, exist_ok=True)
    atexit.register(_at_exit)
    threading.Thread(target=_watch, name="compass-host-probe", daemon=True).start()
