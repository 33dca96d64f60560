"""Start mlx-omni-server 0.5.3 (`mlx-omni-server ARGS`) with the two startup imports that cannot run here stubbed.

Its `main` module runs, at import, `misaki.en.G2P(trf=False)` (text-to-speech), which downloads a
spaCy model over the network; its router imports `tts.tts_service`, whose `f5_tts_mlx` import
builds a Metal kernel at import (`vocos_mlx`: "No Metal back-end" on Linux), and
`images.images_service`, whose `mflux` import fails with the resolved pillow 13.0.0 on Python 3.11
(`PIL._typing` imports `numbers._IntegralLike`). None is on the chat path: the three are replaced
in `sys.modules` by stubs that raise when used; every other module, the chat path included, is the
host's own.

    python scripts/hosts/omni/launch.py --host 127.0.0.1 --port 10240
"""

from __future__ import annotations

import sys
import types


def _unavailable(what: str) -> type:
    class Stub:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError(f"{what} is stubbed off in this run (scripts/hosts/omni/launch.py)")

    return Stub


def install_stubs() -> None:
    g2p = types.ModuleType("misaki.en")
    g2p.G2P = type("G2P", (), {"__init__": lambda self, *a, **k: None})  # the startup call only
    images = types.ModuleType("mlx_omni_server.images.images_service")
    images.ImagesService = _unavailable("image generation (mflux)")
    tts = types.ModuleType("mlx_omni_server.tts.tts_service")
    tts.TTSService = _unavailable("text to speech (f5-tts-mlx, mlx-audio)")
    sys.modules.update(
        {"misaki.en": g2p, "mlx_omni_server.images.images_service": images, "mlx_omni_server.tts.tts_service": tts}
    )


if __name__ == "__main__":
    install_stubs()
    from mlx_omni_server.main import start

    sys.argv[0] = "mlx-omni-server"
    start()
