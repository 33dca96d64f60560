"""Shared fixtures: the tiny checkpoint in both layouts, the recorded reference, the test images."""

from __future__ import annotations

import os
import pathlib

import pytest

from compass_data.tiny import build_tiny_checkpoint
from scripts._lib.recorded import ReferenceFixtures

IMAGES_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "images"


@pytest.fixture(scope="session")
def tiny_ckpt_original(tmp_path_factory) -> pathlib.Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_original"), layout="original")


@pytest.fixture(scope="session")
def tiny_ckpt_mlx(tmp_path_factory) -> pathlib.Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mlx"), layout="mlx")


@pytest.fixture(scope="session")
def reference() -> ReferenceFixtures:
    return ReferenceFixtures()


@pytest.fixture(scope="session")
def fixture_images() -> dict:
    """File name -> path of the synthetic PNGs the reference cases use."""
    return {p.name: p for p in sorted(IMAGES_DIR.glob("*.png"))}


@pytest.fixture(scope="session", autouse=True)
def mlx_vlm_cache_home(tmp_path_factory):
    """mlx-vlm's automatic prefix cache keeps a disk tier under ``$MLX_VLM_CACHE_HOME`` (default
    ~/.cache/mlx-vlm), keyed by prompt tokens: kept there, one run's blocks (or another
    checkpoint's, with the same tokenizer) would be served to the next. Servers inherit it."""
    old = os.environ.get("MLX_VLM_CACHE_HOME")
    os.environ["MLX_VLM_CACHE_HOME"] = str(tmp_path_factory.mktemp("mlx_vlm_cache"))
    yield
    if old is None:
        os.environ.pop("MLX_VLM_CACHE_HOME", None)
    else:
        os.environ["MLX_VLM_CACHE_HOME"] = old


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "reference: needs torch, the oracle; the matrix runs these only in the reference environment "
        "(scripts/env/pins.sh REFERENCE_ENV, `-m reference`)",
    )
