"""Checklist item 12: the installed mlx-vlm's feature surface is listed in docs/features.md.

On every pin of the matrix the item must PASS (every name listed); with a features.md that drops a
name the item must FAIL naming it, so a release that adds a feature is caught by
``scripts/pin_bump/pin_bump.sh``.
"""

from __future__ import annotations

import inspect
import pathlib
import types

import pytest

from scripts.checklist.checks import CHECKS, surface
from scripts.checklist.report import FAIL, ITEMS, PASS

ROOT = pathlib.Path(__file__).resolve().parents[1]
ITEM = next(item for item in ITEMS if item.number == 12)
# The check reads no model: a context with a target kind is enough.
CONTEXT = types.SimpleNamespace(target=types.SimpleNamespace(kind="upstream"))


def test_item_12_is_the_surface_check():
    assert CHECKS[12] is surface.check_feature_surface


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


def test_every_feature_of_this_pin_is_listed():
    got = surface.check_feature_surface(CONTEXT, ITEM)
    assert got.verdict == PASS, got.evidence


def test_a_feature_missing_from_the_doc_fails_by_name(tmp_path):
    doc = (ROOT / "docs" / "features.md").read_text(encoding="utf-8")
    stripped = tmp_path / "features.md"
    stripped.write_text(doc.replace("`kv_bits`", "kv bits").replace("kv_bits=", "bits="), encoding="utf-8")
    assert "kv_bits" not in surface.listed_names(stripped.read_text(encoding="utf-8"))
    got = surface.check_feature_surface(CONTEXT, ITEM, doc_path=stripped)
    assert got.verdict == FAIL and "kv_bits" in got.evidence, got.evidence
    assert got.details["unlisted"] == {"keyword": ["kv_bits"]}


def test_a_missing_doc_fails_and_says_where_to_run(tmp_path):
    got = surface.check_feature_surface(CONTEXT, ITEM, doc_path=tmp_path / "absent.md")
    assert got.verdict == FAIL and "checkout" in got.evidence


@pytest.mark.parametrize(
    "code, names", [("`--kv-bits 8`", {"--kv-bits", "8"}), ("`kv_bits=8`", {"kv_bits", "kv_bits=8"})]
)
def test_listed_names_reads_words_in_backticks(code, names):
    assert names <= surface.listed_names(f"text {code} text")
