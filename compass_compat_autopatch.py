"""compass-compat's opt-in autopatch: patch mlx-vlm when the host first imports it.

``compass_compat_autopatch.pth`` (site-packages) imports this module at interpreter start only
when ``COMPASS_COMPAT_AUTOPATCH`` is 1/true/yes/on, and calls :func:`install`. That puts one
finder at the front of ``sys.meta_path`` and imports nothing else: this module uses ``sys`` and
``_thread`` only, both loaded before any ``.pth`` runs (hence no ``typing``: annotations are plain
classes). It is a top-level module (the wheel
places it next to the ``.pth``) because importing anything inside ``compass_compat`` runs
``compass_compat/__init__.py``, which imports mlx-vlm and applies the patch.

The finder answers for ``mlx_vlm`` alone (``import mlx_vlm.utils`` imports ``mlx_vlm`` first).
It takes the spec the rest of ``sys.meta_path`` finds, so mlx-vlm imports exactly as without
it, and runs ``import compass_compat`` (which applies the patch) right after mlx-vlm's package
module has executed: on the thread that imports mlx-vlm, inside that import, so every other
thread importing mlx-vlm meanwhile waits on the import lock and gets it patched. mlx-vlm 0.3.9
and 0.4.4 create an MLX stream at import that belongs to the importing thread, which is why a
host such as vMLX imports mlx-vlm lazily, on its worker.

A patch that cannot apply fails the host's ``import mlx_vlm`` with its ``CompassCompatError``
(not an ``ImportError``, so an optional-import guard does not swallow it); mlx-vlm stays out of
``sys.modules``, the finder stays, and every later ``import mlx_vlm`` fails the same way: the
host never runs unpatched without being told. After a patch that applied, the finder removes
itself.
"""

import _thread
import sys

ENV = "COMPASS_COMPAT_AUTOPATCH"
TRUE_VALUES = ("1", "true", "yes", "on")  # the .pth line repeats these: it must not import us to test them
TARGET = "mlx_vlm"
SHIM = "compass_compat"
TAG = "__compass_compat__"

_local = _thread._local()  # .busy: this thread is asking the other finders (no recursion)


class _PatchingLoader:
    """mlx-vlm's own loader, plus the patch once its package module has run."""

    def __init__(self, loader: object) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> object:
        if name == "loader":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec: object) -> object:
        create = getattr(self.loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: object) -> None:
        # Leave no trace of this wrapper on mlx_vlm: its __loader__ and __spec__ are mlx-vlm's.
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _patch()


class AutopatchFinder:
    """``sys.meta_path`` entry that patches mlx-vlm as soon as it is imported."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        """The spec the other finders give ``mlx_vlm``, its loader wrapped; None for any other name."""
        if fullname != TARGET or getattr(_local, "busy", False):
            return None
        _local.busy = True
        try:
            spec = _spec_from_the_others(fullname, path, target)
        finally:
            _local.busy = False
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


setattr(AutopatchFinder, TAG, True)
FINDER = AutopatchFinder()


def _spec_from_the_others(fullname: str, path: object, target: object) -> object:
    for finder in list(sys.meta_path):
        if getattr(finder, TAG, False):
            continue
        find = getattr(finder, "find_spec", None)
        spec = None if find is None else find(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _patch() -> None:
    """Apply the patch now (mlx-vlm's package module has run), then stand down."""
    if SHIM in sys.modules:
        # compass_compat is being (or was) imported: its own import applies the patch. This is the
        # host's `import compass_compat` reaching mlx-vlm from apply_patch, which holds the patch
        # lock on this thread: calling apply_patch here would deadlock.
        uninstall()
        return
    try:
        import compass_compat  # compass_compat/__init__.py applies the patch

        compass_compat.apply_patch()  # a no-op after the import; says what this hook is for
    except BaseException as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(
                f"compass-compat's autopatch ({ENV}=1, compass_compat_autopatch.pth) patches mlx-vlm when it "
                f"is first imported, and this import of mlx_vlm failed because the patch could not apply; "
                f"unset {ENV} to run without the patch"
            )
        raise
    uninstall()


def installed() -> bool:
    """Whether the finder is waiting in ``sys.meta_path`` (mlx-vlm not imported yet, or its patch failed)."""
    return any(getattr(f, TAG, False) for f in sys.meta_path)


def install() -> None:
    """Put the finder first in ``sys.meta_path`` (once); patch now if mlx-vlm is already imported."""
    if TARGET in sys.modules:  # something imported it before this hook ran (an earlier .pth)
        _patch()
        return
    if not installed():
        sys.meta_path.insert(0, FINDER)


def uninstall() -> bool:
    """Remove the finder; returns whether it was there."""
    found = False
    for finder in [f for f in sys.meta_path if getattr(f, TAG, False)]:
        try:
            sys.meta_path.remove(finder)
            found = True
        except ValueError:  # another thread removed it first
            pass
    return found
