"""The recorded reference fixtures are current, and the tiny checkpoint and tokenizer match them.

The recording check needs torch + transformers >= 5.21 (the mlxvlm-0.7.10 environment); every
other test here runs in every environment of the matrix.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np
import pytest
from safetensors.numpy import load_file

from compass_data import tiny
from tests.support import model_outputs as recorder
from tests.support.pixels import unpack_pixel_values
from tests.support.reference_probe import reference_problem

LIVE_CASES = ["text_short", "img_448"]
# transformers recomputed on another CPU than the recording one differs from the fixtures by up
# to 3.1e-6 of an array's largest magnitude (logits: 3.1e-5 of 10.0; features: 2.9e-6 of 4.1),
# measured over torch's AVX512 / AVX2 / scalar kernels, MKL and oneDNN limited to AVX2 and SSE4
# (docs/testing.md; an AMD EPYC without AVX-512 gave 2.6e-5 on the logits).
# Three times that: a stale fixture moves values by far more; greedy ids and integers stay exact.
CROSS_CPU_SPREAD = 1e-5


def _why_no_reference():
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        return f"needs torch and transformers >= 5.21 (the mlxvlm-0.7.10 env): {e}"
    if not hasattr(transformers, "CohereCompassForConditionalGeneration"):
        return f"transformers {transformers.__version__} has no CohereCompassForConditionalGeneration"
    return reference_problem()  # tests/support/reference_probe.py


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _config(ckpt: pathlib.Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


# --------------------------------------------------------------------------- checkpoint
def test_weights_match_recorded_sha256_in_both_layouts(reference, tiny_ckpt_original, tiny_ckpt_mlx):
    recorded = reference.index["checkpoint"]["weights_sha256"]
    original = load_file(str(tiny_ckpt_original / "model.safetensors"))
    mlx = load_file(str(tiny_ckpt_mlx / "model.safetensors"))
    assert tiny.weights_sha256(original) == recorded
    assert tiny.weights_sha256(tiny.from_mlx_layout(mlx)) == recorded


@pytest.mark.parametrize("dtype", tiny.DTYPES)
@pytest.mark.parametrize("layout", tiny.LAYOUTS)
def test_checkpoint_bytes_are_reproducible(reference, tmp_path, layout, dtype):
    ckpt = tiny.build_tiny_checkpoint(tmp_path, layout=layout, dtype=dtype)
    recorded = reference.index["checkpoint"]["safetensors_sha256"][f"{layout}/{dtype}"]
    assert _sha256(ckpt / "model.safetensors") == recorded
    names = {p.name for p in ckpt.iterdir()}
    published = {
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors",
    }
    # The MLX conversion adds the processor_config.json that mlx-vlm >= 0.6.13 writes.
    assert names == published | ({"processor_config.json"} if layout == "mlx" else set())


def test_files_carry_the_published_keys(tiny_ckpt_original, tiny_ckpt_mlx):
    tokenizer_config = json.loads((tiny_ckpt_original / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "CohereTokenizer" and tokenizer_config["backend"] == "tokenizers"
    assert "add_bos_token" not in tokenizer_config and tokenizer_config["padding_side"] == "right"
    assert tokenizer_config["processor_class"] == "CohereCompassProcessor"
    assert (tokenizer_config["min_pixels"], tokenizer_config["max_pixels"]) == tiny.tiny_pixel_bounds()
    special = {k: tokenizer_config[k + "_token"] for k in ("bos", "eos", "pad", "unk", "cls", "sep", "mask")}
    assert special == {
        "bos": "<BOS_TOKEN>",
        "eos": "<|END_OF_TURN_TOKEN|>",
        "pad": "<PAD>",
        "unk": "<UNK>",
        "cls": "<CLS>",
        "sep": "<SEP>",
        "mask": "<MASK_TOKEN>",
    }
    assert sorted(tokenizer_config["model_specific_special_tokens"]) == [
        "image_token",
        "video_token",
        "vision_end_token",
        "vision_start_token",
    ]
    ids = tiny.special_token_ids()
    assert [
        ids[t]
        for t in ("<PAD>", "<UNK>", "<CLS>", "<SEP>", "<MASK_TOKEN>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<EOP_TOKEN>")
    ] == list(range(8))  # Cohere's id layout
    preprocessor = json.loads((tiny_ckpt_original / "preprocessor_config.json").read_text())
    assert preprocessor["size"] == {"shortest_edge": 65536, "longest_edge": 16777216}
    assert preprocessor["image_mean"] == preprocessor["image_std"] == [0.5, 0.5, 0.5]
    generation = json.loads((tiny_ckpt_original / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ids["<|END_OF_TURN_TOKEN|>"]
    assert (generation["temperature"], generation["top_p"], generation["top_k"]) == (0.7, 0.8, 20)
    block = json.loads((tiny_ckpt_mlx / "processor_config.json").read_text())["image_processor"]
    assert (block["min_pixels"], block["max_pixels"]) == tiny.tiny_pixel_bounds()


def test_layouts_differ_only_in_names_and_conv_layout(tiny_ckpt_original, tiny_ckpt_mlx):
    original = load_file(str(tiny_ckpt_original / "model.safetensors"))
    mlx = load_file(str(tiny_ckpt_mlx / "model.safetensors"))
    assert all(k.startswith(("model.language_model.", "model.visual.")) for k in original)
    assert all(k.startswith(("language_model.model.", "vision_tower.")) for k in mlx)
    assert not any("lm_head" in k or "position_ids" in k for k in [*original, *mlx])
    torch_conv = original["model.visual.patch_embed.proj.weight"]
    mlx_conv = mlx["vision_tower.patch_embed.proj.weight"]
    assert torch_conv.shape == (32, 3, 2, 16, 16) and mlx_conv.shape == (32, 2, 16, 16, 3)
    np.testing.assert_array_equal(mlx_conv, torch_conv.transpose(0, 2, 3, 4, 1))
    back = tiny.from_mlx_layout(mlx)
    assert back.keys() == original.keys()
    assert all(np.array_equal(back[k], original[k]) for k in original)


def test_small_max_pixels_variant_changes_only_the_image_settings(tmp_path, tiny_ckpt_original):
    small = tiny.build_tiny_checkpoint(tmp_path, variant="small_max_pixels")
    assert _sha256(small / "model.safetensors") == _sha256(tiny_ckpt_original / "model.safetensors")
    assert _config(small) == _config(tiny_ckpt_original)
    default, bounded = (json.loads((d / "tokenizer_config.json").read_text()) for d in (tiny_ckpt_original, small))
    assert (default["max_pixels"], bounded["max_pixels"]) == (602112, 65536)
    assert {k: v for k, v in bounded.items() if k != "max_pixels"} == {
        k: v for k, v in default.items() if k != "max_pixels"
    }
    same = ("generation_config.json", "tokenizer.json", "chat_template.jinja")
    assert all(_sha256(small / n) == _sha256(tiny_ckpt_original / n) for n in same)
    default, bounded = (json.loads((d / "preprocessor_config.json").read_text()) for d in (tiny_ckpt_original, small))
    assert bounded["image_mean"] != default["image_mean"] and bounded["image_std"] != default["image_std"]
    assert {k: v for k, v in bounded.items() if k not in ("image_mean", "image_std")} == {
        k: v for k, v in default.items() if k not in ("image_mean", "image_std")
    }


def test_config_keeps_the_published_quirks(tiny_ckpt_original):
    """Loaders must cope with these; nobody should tidy them away."""
    config = _config(tiny_ckpt_original)
    assert config["fusion_config"] == {"patch_embeddings": True}
    assert config["tie_word_embeddings"] and config["text_config"]["tie_word_embeddings"]
    rope = config["text_config"]["rope_parameters"]
    assert rope["full_attention"] is None and rope["rope_theta"] == 10000.0  # stray key, reference drops it
    assert rope["sliding_attention"]["mrope_section"] == [4, 2, 2]
    for section in (config, config["text_config"], config["vision_config"]):
        assert any(key.startswith("compass_compat_unknown") for key in section)


def test_bfloat16_checkpoint_rounds_the_float32_values(tmp_path):
    mx = pytest.importorskip("mlx.core", reason="mlx reads bfloat16 safetensors; numpy cannot")
    ckpt = tiny.build_tiny_checkpoint(tmp_path, dtype="bfloat16")
    loaded = mx.load(str(ckpt / "model.safetensors"))
    for key, value in tiny.tiny_weights().items():
        assert loaded[key].dtype == mx.bfloat16
        expected = mx.array(value).astype(mx.bfloat16).astype(mx.float32)
        assert mx.array_equal(loaded[key].astype(mx.float32), expected), key


def test_config_ids_are_the_tokenizer_ids(tiny_ckpt_original):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_ckpt_original))
    config = _config(tiny_ckpt_original)
    text = config["text_config"]
    # As published: the embedding has padding rows past the tokenizer's last id.
    assert len(tok) == tiny.tokenizer_vocab_size() < text["vocab_size"] == tiny.PADDED_VOCAB_SIZE
    assert tok.convert_ids_to_tokens(len(tok)) is None and tok.decode([len(tok)]) == ""
    ids = tok.convert_tokens_to_ids
    assert config["image_token_id"] == ids("<|IMAGE_PAD|>")
    assert config["video_token_id"] == ids("<|VIDEO_PAD|>")
    assert config["vision_start_token_id"] == ids("<|VISION_START|>")
    assert config["vision_end_token_id"] == ids("<|VISION_END|>")
    assert config["eos_token_id"] == text["eos_token_id"] == tok.eos_token_id == ids("<|END_OF_TURN_TOKEN|>")
    assert config["pad_token_id"] == tok.pad_token_id == ids("<PAD>")
    assert tok("Hi")["input_ids"][0] == tok.bos_token_id == ids("<BOS_TOKEN>")
    assert tok.decode(tok("Hello, cafe!", add_special_tokens=False)["input_ids"]) == "Hello, cafe!"
    # ASCII-only alphabet: every single token decodes to complete UTF-8 (streamable).
    assert not [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]


def test_chat_template_and_tokenizer_reproduce_reference_input_ids(reference, tiny_ckpt_original):
    """The template rendered by this env's transformers, pads expanded, gives the recorded ids."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_ckpt_original))
    assert (tiny_ckpt_original / "chat_template.jinja").read_text() == tok.chat_template
    image_token_id = _config(tiny_ckpt_original)["image_token_id"]
    for name in reference.cases:
        ref = reference(name)
        prompt = tok.apply_chat_template(ref["meta"]["messages"], tokenize=False, add_generation_prompt=True)
        assert prompt == ref["meta"]["prompt"], name
        pieces = prompt.split("<|IMAGE_PAD|>")
        counts = [int(np.prod(g)) // 4 for g in ref.get("image_grid_thw", np.zeros((0, 3)))]
        assert len(pieces) == len(counts) + 1
        text = pieces[0] + "".join("<|IMAGE_PAD|>" * n + rest for n, rest in zip(counts, pieces[1:]))
        ids = np.asarray([tok(text, add_special_tokens=False)["input_ids"]])
        np.testing.assert_array_equal(ids, ref["input_ids"], err_msg=name)
        if counts:
            np.testing.assert_array_equal(ref["mm_token_type_ids"], (ids == image_token_id).astype(np.int64))


# --------------------------------------------------------------------------- fixtures
def test_fixture_images_are_the_generated_ones(reference, fixture_images):
    from PIL import Image

    assert set(fixture_images) == set(reference.index["images"]) == set(recorder.IMAGES)
    for name, path in fixture_images.items():
        pixels = np.asarray(Image.open(path).convert("RGB"))
        assert hashlib.sha256(pixels.tobytes()).hexdigest() == reference.index["images"][name]["sha256_rgb"]
        np.testing.assert_array_equal(pixels, recorder.make_image(*recorder.IMAGES[name]))


def test_reference_cases_are_complete_and_not_degenerate(reference):
    index = reference.index
    vocab = tiny.PADDED_VOCAB_SIZE
    hidden = tiny.TEXT["hidden_size"]
    assert set(reference.cases) == set(recorder.CASES)
    for name in reference.cases:
        ref, meta = reference(name), reference(name)["meta"]
        length = ref["input_ids"].shape[1]
        assert ref["input_ids"].shape == (1, meta["seq_len"])
        assert ref["prefill_logits"].shape == (length, vocab)
        assert ref["greedy_ids"].tolist() == meta["greedy_ids"] and len(meta["greedy_ids"]) == index["n_greedy"]
        assert ref["greedy_logits"].shape == (index["n_greedy"], vocab)
        np.testing.assert_array_equal(ref["greedy_logits"].argmax(-1), ref["greedy_ids"])
        assert len(set(meta["greedy_ids"])) >= 8, f"{name}: greedy output too repetitive to test with"
        if meta["kind"] == "image":
            grid = ref["image_grid_thw"]
            n_tokens = int(grid.prod(-1).sum()) // 4
            assert ref["pixel_values"].shape == (int(grid.prod(-1).sum()), 3 * 2 * 16 * 16)
            assert ref["position_ids"].shape == (3, 1, length) and ref["rope_deltas"].shape == (1, 1)
            assert int(ref["mm_token_type_ids"].sum()) == n_tokens == sum(meta["num_image_tokens"])
            assert ref["image_features"].shape == (n_tokens, hidden)
            assert ref["deepstack_features"].shape == (len(tiny.VISION["deepstack_visual_indexes"]), n_tokens, hidden)
    assert reference("text_long")["input_ids"].shape[1] >= 4 * tiny.TEXT["sliding_window"]


@pytest.mark.reference
@pytest.mark.skipif(_why_no_reference() is not None, reason=str(_why_no_reference()))
@pytest.mark.parametrize("case", LIVE_CASES)
def test_recorded_fixtures_are_current(reference, case):
    """Re-run the reference in memory; a mismatch means the fixtures are stale: re-record them."""
    results, index = recorder.record([case])
    live, recorded = results[case], reference(case)
    if "pixel_values_codes" in live:
        # The recorder checks that its packing is lossless; this checks the fixture reader's unpacking.
        codes, levels = live.pop("pixel_values_codes"), live.pop("pixel_values_levels")
        live["pixel_values"] = unpack_pixel_values(codes, levels)
    assert live.keys() == recorded.keys() - {"meta"}
    assert index["checkpoint"] == reference.index["checkpoint"]
    assert index["cases"][case] == recorded["meta"]
    for key, value in live.items():
        if np.issubdtype(value.dtype, np.integer):
            np.testing.assert_array_equal(value, recorded[key], err_msg=key)
        else:
            # Another CPU's kernels round differently (CROSS_CPU_SPREAD above).
            atol = CROSS_CPU_SPREAD * float(np.abs(recorded[key]).max())
            np.testing.assert_allclose(value, recorded[key], rtol=0, atol=atol, err_msg=key)
