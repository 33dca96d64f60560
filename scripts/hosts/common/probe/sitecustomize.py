"""In-process probe for the host end-to-end runs (scripts/hosts/common/e2e.py).

The runs put this folder on the host's PYTHONPATH, so Python imports this module at startup
in the host's processes (after the .pth files, so after compass-compat's opt-in hook). It
does nothing unless COMPASS_HOST_PROBE_DIR names a folder. Then a daemon thread waits until
the host itself has imported ``mlx_vlm.models.cohere_compass`` (it never imports mlx-vlm or the
model itself, so the host's import order and threads stay the host's) and writes
``probe-<pid>.json`` there: which file that package was loaded from and
``compass_compat.implementation_info()``, asked inside the host's process. At a clean exit it
also writes ``probe-<pid>-exit.json``: the entry count of every mlx-vlm ``VisionFeatureCache``
alive in the process (hosts pass one to the model as ``vision_cache``; an empty one after
repeated pictures means the model ignored it). The host's code is not touched.
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


def _at_exit(out_dir):
    import gc
    import json
    import sys

    if "mlx_vlm.vision_cache" not in sys.modules:
        return
    kind = getattr(sys.modules["mlx_vlm.vision_cache"], "VisionFeatureCache", None)
    if kind is None:
        return
    sizes = [len(obj) for obj in gc.get_objects() if isinstance(obj, kind)]
    with open(os.path.join(out_dir, f"probe-{os.getpid()}-exit.json"), "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "vision_feature_cache_entries": sizes}, f)


if _DIR:
    import atexit
    import threading

    os.makedirs(_DIR, exist_ok=True)
    atexit.register(_at_exit, _DIR)
    threading.Thread(target=_watch, args=(_DIR,), name="compass-host-probe", daemon=True).start()
