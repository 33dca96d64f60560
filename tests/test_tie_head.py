"""tie_word_embeddings: which head a folder runs, for every key combination, through mlx_vlm.load.

The published config sets the key at the top level and in text_config. transformers 5.24
decides on the top-level key alone (default False), and uses a stored lm_head whatever the
keys say (measured: test_reference_heads_are_the_measured_table re-measures it live where
torch is installed). Where it would run a randomly initialised head (no lm_head stored, top
level not true), text_config's key decides here instead; with neither true the checks refuse.

A stored head is a row permutation of the embedding, so the logits it must give are exact
arithmetic on the tied model's: untied[..., i] == tied[..., perm[i]].
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.support.reference_head import REFERENCE_HEAD
from tests.support.vendored import vendored

vendored()

TOL = 1e-4  # as tests/test_parity.py
COMBOS = sorted(REFERENCE_HEAD, key=str)
EMBED = {"original": "model.language_model.embed_tokens.weight", "mlx": "language_model.model.embed_tokens.weight"}
HEAD = {"original": "lm_head.weight", "mlx": "language_model.lm_head.weight"}


def state(value):
    return {None: "absent", True: "true", False: "false"}[value]


def make_folder(source: pathlib.Path, out: pathlib.Path, layout: str, top, text, head) -> pathlib.Path:
    """A copy of ``source`` with the tie keys set (None: absent) and ``head`` stored as lm_head."""
    shutil.copytree(source, out)
    config = json.loads((source / "config.json").read_text())
    for where, value in ((config, top), (config["text_config"], text)):
        where.pop("tie_word_embeddings", None)
        if value is not None:
            where["tie_word_embeddings"] = value
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(source / "model.safetensors"))
    if head is not None:
        weights[HEAD[layout]] = head
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "mlx" if layout == "mlx" else "pt"})
    return out


@pytest.fixture(scope="module")
def sources(tiny_ckpt_original, tiny_ckpt_mlx):
    return {"original": tiny_ckpt_original, "mlx": tiny_ckpt_mlx}


@pytest.fixture(scope="module")
def skips_sanitize(folders) -> bool:
    """Whether this mlx-vlm's load_model leaves files whose metadata says format "mlx" unsanitized
    (measured: 0.4.4 and 0.6.3 do; 0.6.12, 0.7.10 always call it): the pin's loader, without
    the checks, run on an MLX-layout folder with the package's Model.sanitize spied on."""
    import importlib

    from mlx_vlm.utils import load_model

    model_class = importlib.import_module("mlx_vlm.models.cohere_compass").Model
    real, calls = model_class.sanitize, []

    def spy(self, weights):
        calls.append(1)
        return real(self, weights)

    model_class.sanitize = spy
    try:
        top, text, stored = COMBOS[0]
        load_model.__wrapped__(folders[("mlx", top, text, "permuted" if stored else False)])
    except Exception:  # a head that does not fit fails late; what matters is whether sanitize ran
        pass
    finally:
        model_class.sanitize = real
    return not calls


@pytest.fixture(scope="module")
def permutation(tiny_ckpt_original):
    vocab = json.loads((tiny_ckpt_original / "config.json").read_text())["text_config"]["vocab_size"]
    return np.random.default_rng(0).permutation(vocab)


@pytest.fixture(scope="module")
def folders(sources, permutation, tmp_path_factory):
    """{(layout, top, text, stored): folder}; stored is False, "permuted" or "same"."""
    out = {}
    for layout, source in sources.items():
        embed = load_file(str(source / "model.safetensors"))[EMBED[layout]]
        heads = {False: None, "permuted": np.ascontiguousarray(embed[permutation]), "same": embed.copy()}
        for top, text, stored in COMBOS:
            kinds = ("permuted", "same") if stored else (False,)
            for kind in kinds:
                name = f"{layout}_{state(top)}_{state(text)}_{kind or 'none'}"
                out[layout, top, text, kind] = make_folder(
                    source, tmp_path_factory.mktemp(name) / "m", layout, top, text, heads[kind]
                )
    return out


def input_ids(folder: pathlib.Path) -> np.ndarray:
    vocab = json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"]
    return (np.arange(12, dtype=np.int64) * 37 + 5)[None] % vocab


@functools.lru_cache(maxsize=None)
def logits(folder: str) -> np.ndarray:
    from mlx_vlm import load

    model, _ = load(folder)
    ids = mx.array(input_ids(pathlib.Path(folder)))
    return np.array(model(ids, None, cache=model.language_model.make_cache()).logits[0])


def expected_head(top, text, kind):
    """What this package must run: the reference's head, else text_config's key."""
    reference = REFERENCE_HEAD[top, text, bool(kind)]
    if kind == "same" and top:
        reference = "embedding"  # the reference ties a stored copy of the embedding
    if reference == "random":
        return "embedding" if text else None
    return reference


def built_tied(top, text) -> bool:
    return bool(text if top is None else top)


@pytest.mark.parametrize("layout", ["original", "mlx"])
@pytest.mark.parametrize("top, text, stored", COMBOS, ids=state)
def test_each_key_combination_loads_the_reference_head(
    folders, sources, permutation, skips_sanitize, layout, top, text, stored
):
    from compass_compat.checkpoint_checks import CheckpointError

    tied_logits = logits(str(sources[layout]))  # the default checkpoint: tied, as the reference fixtures
    for kind in ("permuted", "same") if stored else (False,):
        folder = folders[layout, top, text, kind]
        want = expected_head(top, text, kind)
        if want is None:
            # mlx-vlm's strict load names the head the model needs and no file stores.
            match = r"config\.json and the weights disagree \(ValueError: Missing 1 parameters: language_model\.lm_head\.weight"
            with pytest.raises(CheckpointError, match=match):
                logits(str(folder))
            continue
        if layout == "mlx" and skips_sanitize and built_tied(top, text) == bool(kind):
            # Unsanitized, the head built from config.json alone must fit the stored tensors.
            from mlx_vlm.utils import load_model

            with pytest.raises(ValueError, match=r"lm_head"):
                load_model.__wrapped__(folder)  # the pin's own error, which the guard words
            with pytest.raises(CheckpointError, match=r"config\.json and the weights disagree \(ValueError: .*lm_head"):
                logits(str(folder))
            continue
        got = logits(str(folder))
        reference = tied_logits if want == "embedding" or kind == "same" else tied_logits[:, permutation]
        diff = float(np.abs(got - reference).max())
        assert diff < TOL, f"{layout} top={state(top)} text={state(text)} lm_head={kind}: {want} head off by {diff:.3g}"


def test_sanitize_settles_the_head_and_stays_idempotent(folders):
    from mlx_vlm.utils import load_model

    folder = folders["original", None, True, "permuted"]  # built tied, needs untying
    model = load_model(folder)
    assert "lm_head" in model.language_model and model.language_model.tie_word_embeddings is False
    raw = mx.load(str(folder / "model.safetensors"))
    once = model.sanitize(raw)
    twice = model.sanitize(once)
    assert once.keys() == twice.keys() and "language_model.lm_head.weight" in once
    folder = folders["original", False, True, False]  # built untied, needs tying
    model = load_model(folder)
    assert "lm_head" not in model.language_model and model.language_model.tie_word_embeddings is True


# ------------------------------------------------------- the reference, where torch is installed


def reference_run(folder: pathlib.Path, embed: np.ndarray, head):
    torch = pytest.importorskip("torch", reason="the live reference needs torch (the 0.7.10 environment)")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "CohereCompassForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no cohere_compass (needs >= 5.21)")
    torch.manual_seed(0)
    model = transformers.CohereCompassForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    used = model.lm_head.weight.detach().numpy()
    kind = (
        "stored"
        if head is not None and np.array_equal(used, head) and not np.array_equal(head, embed)
        else "embedding"
        if np.array_equal(used, embed)
        else "random"
    )
    with torch.no_grad():
        out = model(input_ids=torch.tensor(input_ids(folder))).logits[0].numpy()
    return kind, out


@pytest.mark.reference
@pytest.mark.parametrize("top, text, stored", COMBOS, ids=state)
def test_reference_heads_are_the_measured_table(folders, sources, permutation, top, text, stored):
    embed = load_file(str(sources["original"] / "model.safetensors"))[EMBED["original"]]
    kinds = ("permuted", "same") if stored else (False,)
    for kind in kinds:
        folder = folders["original", top, text, kind]
        head = None if not kind else (embed[permutation] if kind == "permuted" else embed)
        got, out = reference_run(folder, embed, head)
        want = REFERENCE_HEAD[top, text, bool(kind)]
        if kind == "same":
            want = "embedding"  # a copy of the embedding: tied or not, the same head
        assert got == want, f"top={state(top)} text={state(text)} lm_head={kind}: reference runs the {got} head"
        if expected_head(top, text, kind) is not None and got != "random":
            diff = float(np.abs(logits(str(folder)) - out).max())
            assert diff < TOL, f"top={state(top)} text={state(text)} lm_head={kind}: off the reference by {diff:.3g}"
