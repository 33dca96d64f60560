"""compass-compat's opt-in autopatch: patch mlx-vlm when the host first imports it.

``compass_compat_autopatch.pth`` (site-packages) imports this module at interpreter start only
when ``COMPASS_COMPAT_AUTOPATCH`` is 1/true/yes/on, and calls :func:`install`. That puts one
finder at the front of ``sys.meta_path`` and imports nothing else: this module uses ``_thread``,
``os`` and ``sys`` only, all loaded before any ``.pth`` runs (so no ``typing``: annotations are
plain classes). It is a top-level module (the wheel places it next to the ``.pth``) because
importing anything inside ``compass_compat`` runs ``compass_compat/__init__.py``, which imports
mlx-vlm and applies the patch.

The finder answers for ``mlx_vlm`` alone (``import mlx_vlm.utils`` imports ``mlx_vlm`` first),
and for ``mlx_lm`` too when ``COMPASS_COMPAT_MLX_LM`` opts in to the mlx-lm registration.
It takes the spec the rest of ``sys.meta_path`` finds, so mlx-vlm imports exactly as without
it, and runs ``import compass_compat`` (which applies the patch) right after mlx-vlm's package
module has executed: on the thread that imports mlx-vlm, inside that import, so every other
thread importing mlx-vlm meanwhile waits on the import lock and gets it patched. mlx-vlm 0.4.4
creates an MLX stream at import that belongs to the importing thread, which is why a
host such as vMLX imports mlx-vlm lazily, on its worker.

A patch that cannot apply fails the host's ``import mlx_vlm`` with its ``CompassCompatError``
(not an ``ImportError``, so an optional-import guard does not swallow it); mlx-vlm stays out of
``sys.modules``, the finder stays, and every later ``import mlx_vlm`` fails the same way: the
host never runs unpatched without being told. After a patch that applied, the finder removes
itself.
"""

import _thread
import os  # already imported by the site module that runs .pth files
import sys

ENV = "COMPASS_COMPAT_AUTOPATCH"
TRUE_VALUES = ("1", "true", "yes", "on")  # the .pth line repeats these: it must not import us to test them
MLX_LM_ENV = "COMPASS_COMPAT_MLX_LM"  # apply_patch also registers with mlx-lm: mlx_lm alone triggers too
SHIM = "compass_compat"
TAG = "__compass_compat__"

# Per thread: .busy while this finder asks the others (no recursion); .depth, how many of the
# targets this thread is executing (mlx-vlm imports mlx-lm: patch once the outermost is done).
_local = _thread._local()


def targets(environ: object = None) -> tuple:
    """The packages whose first import applies the patch: ``mlx_vlm``, and ``mlx_lm`` with
    ``COMPASS_COMPAT_MLX_LM`` opted in (a host that loads through mlx-lm never imports mlx-vlm)."""
    environ = os.environ if environ is None else environ
    mlx_lm = environ.get(MLX_LM_ENV, "").strip().lower() in TRUE_VALUES
    return ("mlx_vlm", "mlx_lm") if mlx_lm else ("mlx_vlm",)


class _PatchingLoader:
    """The package's own loader, plus the patch once its package module has run."""

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
        # Leave no trace of this wrapper on the module: its __loader__ and __spec__ are its own.
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            self.loader.exec_module(module)
        finally:
            _local.depth -= 1
        if _local.depth == 0:  # not inside another target's import (it patches when it is done)
            _patch(module.__name__)


class AutopatchFinder:
    """``sys.meta_path`` entry that patches mlx-vlm as soon as it (or a target) is imported."""

    def __init__(self, names: tuple = ("mlx_vlm",)) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        """The spec the other finders give a target, its loader wrapped; None for any other name."""
        if fullname not in self.names or getattr(_local, "busy", False):
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


def _spec_from_the_others(fullname: str, path: object, target: object) -> object:
    for finder in list(sys.meta_path):
        if getattr(finder, TAG, False):
            continue
        find = getattr(finder, "find_spec", None)
        spec = None if find is None else find(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _patch(name: str) -> None:
    """Apply the patch now (``name``'s package module has run), then stand down."""
    if SHIM in sys.modules:
        # compass_compat is being (or was) imported, and that import applies the patch: this is
        # apply_patch itself importing a target (for this hook, or for a host that imports
        # compass_compat), holding the patch lock on this thread, so applying here would deadlock.
        # The finder stays until this hook's own patch succeeds; after a host's own import it
        # stays inert (its targets are imported, so it is not asked again).
        return
    try:
        import compass_compat  # compass_compat/__init__.py applies the patch

        compass_compat.apply_patch()  # a no-op after the import; says what this hook is for
    except BaseException as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(
                f"compass-compat's autopatch ({ENV}=1, compass_compat_autopatch.pth) patches mlx-vlm when "
                f"{name} is first imported, and this import of {name} failed because the patch could not "
                f"apply; unset {ENV} to run without the patch"
            )
        raise
    uninstall()


def installed() -> bool:
    """Whether the finder is waiting in ``sys.meta_path`` (no target imported yet, or the patch failed)."""
    return any(getattr(f, TAG, False) for f in sys.meta_path)


def install() -> None:
    """Put the finder first in ``sys.meta_path`` (once); patch now if a target is already imported."""
    names = targets()
    imported = [n for n in names if n in sys.modules]
    if imported:  # something imported it before this hook ran (an earlier .pth)
        _patch(imported[0])
        return
    if not installed():
        sys.meta_path.insert(0, AutopatchFinder(names))


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
