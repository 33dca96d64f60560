"""Checklist item 12: the installed mlx-vlm's feature surface is listed in docs/features.md.

On every pin of the matrix every name must be listed; with a features.md that drops a name the
check must name it, so a release that adds a feature is caught by ``scripts/pin_bump/pin_bump.sh``.
"""

from __future__ import annotations

import inspect
import pathlib

import pytest

from tests.support import feature_surface as surface

ROOT = pathlib.Path(__file__).resolve().parents[1]


def unlisted_in(doc_path: pathlib.Path) -> dict:
    """The installed mlx-vlm's names that ``doc_path`` does not list, per kind."""
    return surface.unlisted(surface.feature_surface(), doc_path.read_text(encoding="utf-8"))


def test_the_surface_is_read_from_the_installed_mlx_vlm():
    """Independent of the reader: names read straight from the pin's own objects and files."""
    from mlx_vlm.generate import generate_step

    found = surface.feature_surface()
    assert set(inspect.signature(generate_step).parameters) - {"kwargs"} <= set(found["keyword"])
    assert "kv_bits" in found["keyword"] and "mlx_vlm.server" in found["module"]
    assert "/health" in found["route"]
    import mlx_vlm

    server = pathlib.Path(mlx_vlm.__file__).parent / "server.py"
    if server.is_file() and '"--port"' in server.read_text(encoding="utf-8"):
        assert "--port" in found["server flag"]


@pytest.mark.checklist(12)
def test_every_feature_of_this_pin_is_listed():
    missing = unlisted_in(surface.FEATURES_DOC)
    assert not missing, (
        "not in docs/features.md: "
        + "; ".join(f"{kind}s {', '.join(names)}" for kind, names in missing.items())
        + ": give each a row (tested or refused by name), or list it"
    )


def test_a_feature_missing_from_the_doc_fails_by_name(tmp_path):
    doc = surface.FEATURES_DOC.read_text(encoding="utf-8")
    stripped = tmp_path / "features.md"
    stripped.write_text(doc.replace("`kv_bits`", "kv bits").replace("kv_bits=", "bits="), encoding="utf-8")
    assert "kv_bits" not in surface.listed_names(stripped.read_text(encoding="utf-8"))
    assert unlisted_in(stripped) == {"keyword": ["kv_bits"]}


@pytest.mark.parametrize(
    "code, names", [("`--kv-bits 8`", {"--kv-bits", "8"}), ("`kv_bits=8`", {"kv_bits", "kv_bits=8"})]
)
def test_listed_names_reads_words_in_backticks(code, names):
    assert names <= surface.listed_names(f"text {code} text")
