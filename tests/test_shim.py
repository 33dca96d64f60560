"""The patch shim: path, the implementation switch, prompt format, processor hook, all-or-nothing.

Runs on every pin. Expectations come from the pin (mlx-vlm >= 0.6.13 ships its own
cohere_compass), the recorded verdicts read as data (compass_compat/verdicts.json) and
COMPASS_COMPAT_IMPLEMENTATION, which scripts/check/matrix.sh sets to upstream for one 0.7.10
run; never from the shim itself.
Scenarios that must start from a fresh interpreter (env var set before import,
upstream imported before the shim) run in subprocesses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Dict, Optional

import mlx_vlm
import mlx_vlm.models
import pytest
from mlx_vlm import prompt_utils
from mlx_vlm.utils import get_model_and_args
from transformers import AutoProcessor

import compass_compat
from compass_compat import CompassCompatError, apply_patch, checkpoint_checks, implementation_info, remove_patch
from tests.support.vendored import PINS, default_run_only, expected_live, switch_from_env, upstream_ships

REPO = Path(__file__).resolve().parents[1]
PKG = "mlx_vlm.models.cohere_compass"
VENDORED_PKG = compass_compat.vendor_root() / "mlx_vlm" / "models" / "cohere_compass"
MLX_VLM_VERSION = str(mlx_vlm.__version__)
# Whether this mlx-vlm ships its own models/cohere_compass (0.6.13 was the first release that did).
UPSTREAM_SHIPS = upstream_ships()
SWITCH = switch_from_env()
DEFAULT_LIVE = expected_live()
# Where upstream ships one, the vendored package is made live over it (purging upstream's modules).
# Made live at once (purging upstream's modules) where upstream ships one, or where the switch asks.
FORCED = DEFAULT_LIVE == "vendored" and (UPSTREAM_SHIPS or SWITCH == "vendored")
TORCH_INSTALLED = importlib.util.find_spec("torch") is not None

IMAGE_BLOCK = "<|VISION_START|><|IMAGE_PAD|><|VISION_END|>"
# The cohere_compass prompt shape, enough to count image parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|START_OF_TURN_TOKEN|>"
    "{% if message.role == 'user' %}<|USER_TOKEN|>{% elif message.role == 'assistant' %}"
    "<|CHATBOT_TOKEN|>{% else %}<|SYSTEM_TOKEN|>{% endif %}"
    "{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}{% if part.type == 'image' %}"
    + IMAGE_BLOCK
    + "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
    "<|END_OF_TURN_TOKEN|>{% endfor %}"
    "{% if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}"
)


# ------------------------------------------------------------------ helpers


def within(path: Optional[str], directory: Path) -> bool:
    if not path:
        return False
    real, base = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([real, base]) == base


def kind_of(path: Optional[str]) -> str:
    if path is None:
        return "none"
    return "vendored" if within(path, VENDORED_PKG) else "upstream"


def loader_file() -> str:
    """The file of the cohere_compass package mlx-vlm's own loader resolves."""
    arch, model_type = get_model_and_args({"model_type": "cohere_compass"})
    assert model_type == "cohere_compass"
    return arch.__file__


def package_modules() -> Dict[str, Any]:
    return {n: m for n, m in sys.modules.items() if n == PKG or n.startswith(PKG + ".")}


def is_our_hook() -> bool:
    return bool(getattr(AutoProcessor.from_pretrained, "__compass_compat__", False))


def shim_state() -> Dict[str, Any]:
    """Everything apply_patch may touch, by value and identity."""
    models_path = getattr(mlx_vlm.models, "__path__", None)
    table = getattr(prompt_utils, "MODEL_CONFIG", None)
    lm_path = getattr(importlib.import_module("mlx_lm.models"), "__path__", None)
    return {
        "mlx_vlm.__path__": list(mlx_vlm.__path__),
        "mlx_vlm.models.__path__": None if models_path is None else list(models_path),
        "MODEL_CONFIG": None if table is None else dict(table),
        "MODEL_CONFIG id": id(table),
        "AutoProcessor.from_pretrained": vars(AutoProcessor).get("from_pretrained"),
        "modules": {n: id(m) for n, m in package_modules().items()},
        "models.cohere_compass": id(vars(mlx_vlm.models).get("cohere_compass")),
        "mlx_lm.models.__path__": None if lm_path is None else list(lm_path),
    }


def run_python(code: str, env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None) -> Dict[str, Any]:
    """Run ``code`` in a fresh interpreter of this env; return the JSON of its last stdout line."""
    full_env = {
        k: v for k, v in os.environ.items() if k not in (compass_compat.FORCE_ENV, compass_compat.IMPLEMENTATION_ENV)
    }
    full_env["PYTHONPATH"] = str(REPO)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=str(cwd or REPO),
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tiny_tokenizer() -> Any:
    """An in-memory fast tokenizer carrying the cohere_compass-style chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<BOS_TOKEN>": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<BOS_TOKEN>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_config(folder: Path, config: Dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def unpatched():
    """Start from an unpatched mlx-vlm; afterwards restore the session's patch and modules.

    The session's cohere_compass module objects are put back before re-applying,
    so other test files keep seeing the classes they imported.
    """
    root = compass_compat.vendor_root()
    saved = {
        n: m for n, m in sys.modules.items() if n.startswith("mlx_vlm.") and within(getattr(m, "__file__", None), root)
    }
    saved.update(package_modules())
    saved_attr = vars(mlx_vlm.models).get("cohere_compass")
    remove_patch()
    yield
    remove_patch()
    for name in package_modules():
        del sys.modules[name]
    sys.modules.update(saved)
    if saved_attr is not None:
        mlx_vlm.models.cohere_compass = saved_attr
    apply_patch()


# ----------------------------------------------------------- resolution


def test_pin_expectation_matches_installed_tree():
    """The version rule the tests use agrees with what the installed mlx-vlm contains."""
    info = implementation_info()
    assert info.upstream_available is UPSTREAM_SHIPS
    assert info.mlx_vlm_version == MLX_VLM_VERSION


def test_vendored_dirs_appended_once_after_upstream():
    upstream_dir = os.path.dirname(mlx_vlm.__file__)
    ours = str(compass_compat.vendor_root() / "mlx_vlm")
    for path, own, vendored in (
        (mlx_vlm.__path__, upstream_dir, ours),
        (mlx_vlm.models.__path__, os.path.join(upstream_dir, "models"), os.path.join(ours, "models")),
    ):
        real = [os.path.realpath(p) for p in path]
        assert real.count(os.path.realpath(vendored)) == 1
        assert real.index(os.path.realpath(own)) < real.index(os.path.realpath(vendored))


def test_loader_resolves_expected_implementation():
    file = loader_file()
    assert kind_of(file) == DEFAULT_LIVE, file
    info = implementation_info()
    assert (info.implementation, info.file, info.loaded) == (DEFAULT_LIVE, file, True)
    assert info.patched and info.forced is FORCED
    assert info.switch == SWITCH
    assert MLX_VLM_VERSION in info.reason


def test_implementation_info_before_import_reports_resolvable_file(unpatched):
    apply_patch("upstream" if UPSTREAM_SHIPS else "auto")
    for name in package_modules():
        del sys.modules[name]
    info = implementation_info()
    assert info.loaded is False
    expected = "upstream" if UPSTREAM_SHIPS else "vendored"
    assert kind_of(info.file) == info.implementation == expected


def test_force_argument_replaces_already_imported_module(unpatched):
    assert apply_patch("upstream" if UPSTREAM_SHIPS else "auto") is True
    before = loader_file()  # imports upstream's on 0.6.13+: the "already imported" case
    assert kind_of(before) == ("upstream" if UPSTREAM_SHIPS else "vendored")
    assert apply_patch(force_vendored=True) is True
    assert apply_patch(force_vendored=True) is False
    live = sys.modules[PKG]
    assert within(live.__file__, VENDORED_PKG)
    assert mlx_vlm.models.cohere_compass is live
    assert kind_of(loader_file()) == "vendored"
    assert all(within(m.__file__, VENDORED_PKG) for m in package_modules().values() if getattr(m, "__file__", None))
    info = implementation_info()
    assert (info.implementation, info.forced) == ("vendored", True)
    assert "force_vendored=True" in info.reason
    assert is_our_hook()
    assert prompt_utils.MODEL_CONFIG["cohere_compass"] is prompt_utils.MessageFormat.LIST_WITH_IMAGE_FIRST

    assert remove_patch() is True
    after = implementation_info()
    assert after.implementation == ("upstream" if UPSTREAM_SHIPS else "none")
    if UPSTREAM_SHIPS:
        assert sys.modules[PKG].__file__ == before  # the purged upstream module is back


SWITCHES = {  # scenario -> (environment, switch value it stands for)
    "auto": ({}, "auto"),
    "vendored": ({"COMPASS_COMPAT_IMPLEMENTATION": "vendored"}, "vendored"),
    "upstream": ({"COMPASS_COMPAT_IMPLEMENTATION": "upstream"}, "upstream"),
    "force-alias": ({"COMPASS_COMPAT_FORCE_VENDORED": "1"}, "vendored"),
    "force-off": ({"COMPASS_COMPAT_FORCE_VENDORED": "0"}, "auto"),
}


@default_run_only  # run_python sets each scenario's own switch
@pytest.mark.parametrize("imported_first", [False, True], ids=["fresh", "upstream-imported-first"])
@pytest.mark.parametrize("scenario", sorted(SWITCHES))
def test_switch_in_fresh_interpreter(scenario, imported_first):
    env, switch = SWITCHES[scenario]
    if switch == "upstream" and not UPSTREAM_SHIPS:
        pytest.skip(f"mlx-vlm {MLX_VLM_VERSION} ships no cohere_compass: upstream is refused (next test)")
    code = f"""
        import json, sys
        pre = None
        if {imported_first!r}:
            try:
                import mlx_vlm.models.cohere_compass as up
                pre = up.__file__
            except ModuleNotFoundError:
                pre = None
        import compass_compat
        from mlx_vlm.utils import get_model_and_args
        arch, _ = get_model_and_args({{"model_type": "cohere_compass"}})
        from transformers import AutoProcessor
        info = compass_compat.implementation_info()
        print(json.dumps(dict(pre=pre, file=arch.__file__, live=sys.modules[arch.__name__].__file__,
            impl=info.implementation, forced=info.forced, switch=info.switch, reason=info.reason,
            verdict=info.verdict, hook=bool(getattr(AutoProcessor.from_pretrained, "__compass_compat__", False)))))
    """
    out = run_python(code, env)
    expected = expected_live(switch)
    assert kind_of(out["file"]) == kind_of(out["live"]) == out["impl"] == expected
    forced = expected == "vendored" and (UPSTREAM_SHIPS or switch == "vendored")
    assert (out["switch"], out["forced"], out["hook"]) == (switch, forced, expected == "vendored")
    if UPSTREAM_SHIPS:
        assert MLX_VLM_VERSION in out["verdict"] and "item" in out["verdict"]
        if switch == "auto":  # the choice names what the record says
            assert out["verdict"] in out["reason"]
    if imported_first:
        assert (out["pre"] is not None) is UPSTREAM_SHIPS


def test_upstream_where_mlx_vlm_ships_none_is_refused(unpatched):
    if UPSTREAM_SHIPS:
        pytest.skip(f"mlx-vlm {MLX_VLM_VERSION} ships its own cohere_compass")
    before = shim_state()
    with pytest.raises(CompassCompatError, match="ships none"):
        apply_patch("upstream")
    assert shim_state() == before


@pytest.mark.parametrize("value", ["foo", "forced", "1"])
def test_bad_switch_value_is_named(unpatched, monkeypatch, value):
    monkeypatch.setenv(compass_compat.IMPLEMENTATION_ENV, value)
    before = shim_state()
    with pytest.raises(CompassCompatError, match="auto, vendored, upstream"):
        apply_patch()
    assert shim_state() == before


def test_switch_and_alias_that_disagree_are_refused(unpatched, monkeypatch):
    monkeypatch.setenv(compass_compat.IMPLEMENTATION_ENV, "upstream")
    monkeypatch.setenv(compass_compat.FORCE_ENV, "1")
    with pytest.raises(CompassCompatError, match="unset one of them"):
        apply_patch()


def test_invalid_force_value_is_loud(unpatched, monkeypatch):
    monkeypatch.setenv(compass_compat.FORCE_ENV, "maybe")
    before = shim_state()
    with pytest.raises(CompassCompatError, match=compass_compat.FORCE_ENV):
        apply_patch()
    assert shim_state() == before


# ----------------------------------------------------- idempotence, threads


def test_second_apply_is_a_noop():
    before = shim_state()
    assert apply_patch() is False
    assert apply_patch(SWITCH) is False
    assert shim_state() == before


def test_eight_threads_apply_exactly_once(unpatched):
    barrier = threading.Barrier(8)
    results, errors = [], []

    def worker() -> None:
        barrier.wait()
        try:
            results.append(apply_patch())
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(results) == [False] * 7 + [True]
    ours = os.path.realpath(compass_compat.vendor_root() / "mlx_vlm" / "models")
    assert [os.path.realpath(p) for p in mlx_vlm.models.__path__].count(ours) == 1
    if is_our_hook():  # exactly one wrapper: the one below it is not ours
        inner = AutoProcessor.from_pretrained.__compass_compat_original__
        assert not getattr(getattr(inner, "__func__", inner), "__compass_compat__", False)


# --------------------------------------------------------- all or nothing


@pytest.mark.parametrize(
    "owner, attr",
    [
        ("mlx_vlm.prompt_utils", "MODEL_CONFIG"),
        ("mlx_vlm.prompt_utils", "MessageFormat"),
        ("mlx_vlm.models", "__path__"),
        ("transformers.AutoProcessor", "from_pretrained"),
        ("mlx_lm.models", "__path__"),  # looked up only with mlx_lm=True
    ],
)
def test_missing_hook_raises_and_leaves_mlx_vlm_unchanged(unpatched, monkeypatch, owner, attr):
    target = AutoProcessor if owner == "transformers.AutoProcessor" else importlib.import_module(owner)
    monkeypatch.delattr(target, attr)
    before = shim_state()
    with pytest.raises(CompassCompatError) as err:
        apply_patch(force_vendored=True, mlx_lm=owner.startswith("mlx_lm."))
    assert f"{owner}.{attr}" in str(err.value) and MLX_VLM_VERSION in str(err.value)
    assert err.value.hooks == (f"{owner}.{attr}",)
    assert err.value.mlx_vlm_version == MLX_VLM_VERSION
    assert shim_state() == before
    assert implementation_info().patched is False


# The refusal a user of an mlx-vlm older than 0.4 reads.
OLD_RELEASE_REFUSAL = (
    "compass-compat does not support mlx-vlm {version}: it supports mlx-vlm 0.4 and later (tested: 0.4.4, 0.6.3, "
    "0.6.12, 0.7.10); upgrade with pip install 'mlx-vlm>=0.4.4'; mlx-vlm was left unchanged"
)


def test_the_refusal_names_the_matrix_pins():
    tested = sorted({pin.split("-")[0] for pin in PINS}, key=lambda v: tuple(map(int, v.split("."))))
    assert f"(tested: {', '.join(tested)})" in OLD_RELEASE_REFUSAL


@pytest.mark.parametrize("version", ["0.3.9", "0.3.12", "0.1.0"])
def test_an_mlx_vlm_older_than_0_4_is_refused_by_name_and_left_unchanged(unpatched, monkeypatch, version):
    monkeypatch.setattr(mlx_vlm, "__version__", version)
    before = shim_state()
    with pytest.raises(CompassCompatError) as err:
        apply_patch(force_vendored=True, mlx_lm=True)
    assert str(err.value) == OLD_RELEASE_REFUSAL.format(version=version)
    assert err.value.mlx_vlm_version == version and err.value.hooks == ()
    assert shim_state() == before
    assert implementation_info().patched is False


def test_importing_the_package_on_mlx_vlm_0_3_raises_the_refusal_alone():
    """``import compass_compat`` in a fresh interpreter whose mlx-vlm says 0.3.9: the one-line
    refusal, and mlx-vlm's model path and prompt-format table as they were."""
    result = run_python(
        """
        import json, traceback
        import mlx_vlm, mlx_vlm.models
        from mlx_vlm import prompt_utils
        mlx_vlm.__version__ = "0.3.9"
        path, table = list(mlx_vlm.models.__path__), dict(prompt_utils.MODEL_CONFIG)
        try:
            import compass_compat
            outcome = None
        except Exception as error:
            outcome = [type(error).__name__, str(error), traceback.extract_tb(error.__traceback__)[-1].filename]
        print(json.dumps({
            "outcome": outcome,
            "path unchanged": list(mlx_vlm.models.__path__) == path,
            "table unchanged": dict(prompt_utils.MODEL_CONFIG) == table,
        }))
        """
    )
    assert result["outcome"][:2] == ["CompassCompatError", OLD_RELEASE_REFUSAL.format(version="0.3.9")]
    assert "\n" not in result["outcome"][1]
    assert Path(result["outcome"][2]).parts[-2:] == ("compass_compat", "__init__.py")  # no frames of mlx-vlm
    assert result["path unchanged"] and result["table unchanged"]


class _ExplodingTable(dict):
    def __setitem__(self, key: Any, value: Any) -> None:
        raise RuntimeError("boom: MODEL_CONFIG refused the entry")


@pytest.mark.parametrize("stage", ["message-format", "processor-hook"])
def test_failure_midway_is_undone(unpatched, monkeypatch, stage):
    if stage == "message-format":
        table = _ExplodingTable({k: v for k, v in prompt_utils.MODEL_CONFIG.items() if k != "cohere_compass"})
        monkeypatch.setattr(prompt_utils, "MODEL_CONFIG", table)
    else:
        import compass_compat._patch as patch_module

        def explode(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("boom: processor hook")

        monkeypatch.setattr(patch_module, "_install_processor_hook", explode)
    before = shim_state()
    with pytest.raises(RuntimeError, match="boom"):
        apply_patch(force_vendored=True)  # forcing: paths, modules, table and hook all change
    assert shim_state() == before
    assert implementation_info().patched is False


# --------------------------------------------------------- prompt format


def test_message_format_registered_in_place(unpatched):
    table = prompt_utils.MODEL_CONFIG
    had_upstream_entry = "cohere_compass" in table
    assert had_upstream_entry is UPSTREAM_SHIPS
    upstream_value = table.get("cohere_compass")
    apply_patch()
    assert prompt_utils.MODEL_CONFIG is table
    # The image-first list format, the one qwen3_vl uses on every pin.
    assert table["cohere_compass"] is prompt_utils.MessageFormat.LIST_WITH_IMAGE_FIRST
    assert table["qwen3_vl"] is prompt_utils.MessageFormat.LIST_WITH_IMAGE_FIRST
    if had_upstream_entry and DEFAULT_LIVE == "upstream":
        assert table["cohere_compass"] is upstream_value


@pytest.mark.parametrize("num_images", [1, 2])
def test_chat_template_keeps_one_placeholder_per_image(num_images):
    tok = tiny_tokenizer()
    messages = prompt_utils.apply_chat_template(
        tok, {"model_type": "cohere_compass"}, "Describe.", num_images=num_images, return_messages=True
    )
    assert [p["type"] for p in messages[0]["content"]] == ["image"] * num_images + ["text"]
    text = prompt_utils.apply_chat_template(tok, {"model_type": "cohere_compass"}, "Describe.", num_images=num_images)
    assert text == (
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>"
        + IMAGE_BLOCK * num_images
        + "Describe.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )


@pytest.mark.parametrize("num_images", [1, 2])
def test_chat_template_of_the_tiny_checkpoint_keeps_one_placeholder_per_image(tiny_ckpt_original, num_images):
    """The same through the live processor and the checkpoint's own chat template."""
    importlib.import_module(PKG + ".processing_cohere_compass")  # as mlx_vlm.load imports it first
    processor = AutoProcessor.from_pretrained(str(tiny_ckpt_original))
    config = json.loads((Path(tiny_ckpt_original) / "config.json").read_text())
    text = prompt_utils.apply_chat_template(processor, config, "Describe.", num_images=num_images)
    assert text.count(IMAGE_BLOCK) == text.count("<|IMAGE_PAD|>") == num_images
    assert text.index(IMAGE_BLOCK * num_images) < text.index("Describe.")


def test_other_model_types_format_unchanged(unpatched):
    tok = tiny_tokenizer()

    def render() -> Any:
        return [
            prompt_utils.apply_chat_template(tok, {"model_type": t}, "Describe.", num_images=2, return_messages=rm)
            for t in ("qwen2_vl", "qwen3_vl", "idefics3")
            for rm in (True, False)
        ]

    table_before = {k: v for k, v in prompt_utils.MODEL_CONFIG.items() if k != "cohere_compass"}
    before = render()
    apply_patch()
    assert render() == before
    assert {k: v for k, v in prompt_utils.MODEL_CONFIG.items() if k != "cohere_compass"} == table_before


# ------------------------------------------------------ processor hook


def test_processor_hook_installed_only_where_vendored_is_live():
    # Upstream's own processing module registers upstream's processor (0.6.13+).
    assert is_our_hook() is (DEFAULT_LIVE == "vendored")


def test_processor_hook_routes_only_compass_folders(unpatched, monkeypatch, tmp_path):
    calls = []

    def spy(cls: type, path: Any, *args: Any, **kwargs: Any) -> str:
        calls.append((cls, path, args, kwargs))
        return "original"

    monkeypatch.setattr(AutoProcessor, "from_pretrained", classmethod(spy))
    assert apply_patch(force_vendored=True) is True  # installs the hook on every pin
    assert is_our_hook()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    others = [
        str(write_config(tmp_path / "qwen", {"model_type": "qwen2_vl"})),
        write_config(tmp_path / "qwen_path", {"model_type": "qwen2_vl"}),
        "SomeOrg/some-remote-repo",
        str(tmp_path / "empty"),
        str(broken),
    ]
    for target in others:
        assert AutoProcessor.from_pretrained(target, use_fast=True) == "original"
        assert calls[-1] == (AutoProcessor, target, (), {"use_fast": True})

    processing = importlib.import_module(PKG + ".processing_cohere_compass")  # the module the hook imports
    assert within(processing.__file__, VENDORED_PKG)
    seen = []

    class FakeProcessor:
        @classmethod
        def from_pretrained(cls, path: Any, **kwargs: Any) -> str:
            seen.append((path, kwargs))
            return "vendored"

    monkeypatch.setattr(processing, "CohereCompassProcessor", FakeProcessor, raising=False)
    checked = []
    # The hook checks the folder first; these config-only folders are about routing.
    monkeypatch.setattr(
        checkpoint_checks, "validate_checkpoint", lambda path, **kwargs: checked.append((path, kwargs, len(seen)))
    )
    n_calls = len(calls)
    for compass in (
        write_config(tmp_path / "compass", {"model_type": "cohere_compass"}),
        str(write_config(tmp_path / "Compass2", {"model_type": "Cohere_Compass"})),
    ):
        assert AutoProcessor.from_pretrained(compass, use_fast=True) == "vendored"
        assert seen[-1] == (compass, {"use_fast": True})
        assert checked[-1] == (compass, {}, len(seen) - 1)  # before the processor
    assert len(calls) == n_calls


def test_autoprocessor_for_a_real_non_compass_folder_unchanged(unpatched, tmp_path):
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    write_config(
        tmp_path,
        {
            "model_type": "llama",
            "vocab_size": 4,
            "hidden_size": 8,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "intermediate_size": 16,
        },
    )
    plain = AutoProcessor.from_pretrained(str(tmp_path))
    apply_patch(force_vendored=True)
    assert is_our_hook()
    patched = AutoProcessor.from_pretrained(str(tmp_path))
    assert type(patched) is type(plain)
    assert patched.get_vocab() == plain.get_vocab()
    assert patched("hello world")["input_ids"] == plain("hello world")["input_ids"] == [2, 3]


def test_autoprocessor_builds_the_live_processor_from_the_tiny_checkpoint(tiny_ckpt_original):
    processing = importlib.import_module(PKG + ".processing_cohere_compass")
    processor = AutoProcessor.from_pretrained(str(tiny_ckpt_original))
    assert type(processor).__module__ == processing.__name__
    assert isinstance(processor, processing.CohereCompassProcessor)
    assert kind_of(sys.modules[type(processor).__module__].__file__) == DEFAULT_LIVE


def test_each_vendored_module_is_loaded_once_per_process(tiny_ckpt_original):
    """A checkpoint checked, loaded and its processor built: one module object per vendored file
    (the checks, the model and the processor share one copy, and so its module-level state)."""
    code = textwrap.dedent(
        f"""
        import collections, json, os, sys
        import mlx_vlm
        import compass_compat
        from compass_compat.checkpoint_checks import validate_checkpoint
        from compass_compat.vendor import vendor_root, within
        validate_checkpoint({str(tiny_ckpt_original)!r})
        mlx_vlm.load({str(tiny_ckpt_original)!r})
        files = collections.Counter(
            os.path.realpath(m.__file__) for m in list(sys.modules.values())
            if within(getattr(m, "__file__", None), vendor_root())
        )
        print("ONCE-JSON " + json.dumps(files))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "COMPASS_COMPAT_AUTOPATCH"}
    env["COMPASS_COMPAT_IMPLEMENTATION"] = "vendored"  # the vendored files are what it counts
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    line = next((row for row in proc.stdout.splitlines() if row.startswith("ONCE-JSON ")), None)
    assert line, proc.stderr[-3000:]
    files = json.loads(line[len("ONCE-JSON ") :])
    assert any(f.endswith("processing_cohere_compass.py") for f in files), files
    assert {f: n for f, n in files.items() if n > 1} == {}


# ----------------------------------------------------------- layout, torch


def test_vendored_helpers_cannot_collide_with_upstream_modules():
    root = compass_compat.vendor_root() / "mlx_vlm"
    assert {p.name for p in root.iterdir() if p.name != "__pycache__"} == {"models"}
    assert not (root / "__init__.py").exists() and not (root / "models" / "__init__.py").exists()
    installed = Path(mlx_vlm.__file__).parent / "models"
    for entry in (root / "models").iterdir():
        if entry.name in {"cohere_compass", "__pycache__"}:
            continue
        name = entry.stem if entry.suffix == ".py" else entry.name
        assert name.startswith("_compass_"), f"{entry} must be named _compass_*"
        assert not (installed / name).exists() and not (installed / f"{name}.py").exists()


@pytest.mark.skipif(
    TORCH_INSTALLED,
    reason="torch is installed here and transformers >= 5 imports it whenever it is; "
    "test_import_is_torch_free_with_torch_hidden covers this env, this test the torch-free pins",
)
def test_import_does_not_import_torch():
    out = run_python(
        """
        import json, sys
        import compass_compat
        print(json.dumps({"torch": "torch" in sys.modules}))
        """,
        cwd=Path("/"),
    )
    assert out == {"torch": False}


HIDE_TORCH = """
import importlib.machinery, sys
_HIDDEN = {"torch", "torchvision", "torchaudio"}
class _NoTorchFinder:
    '''PathFinder minus torch: the interpreter behaves as if torch were not installed.'''
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
    @classmethod
    def find_distributions(cls, *args, **kwargs):
        for dist in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if (dist.metadata["Name"] or "").lower() not in _HIDDEN:
                yield dist
    @classmethod
    def invalidate_caches(cls):
        importlib.machinery.PathFinder.invalidate_caches()
sys.meta_path[:] = [_NoTorchFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


@pytest.mark.reference  # where torch is installed
def test_import_is_torch_free_with_torch_hidden():
    """On a machine without torch, importing the shim and the live package works and stays torch-free."""
    out = run_python(
        HIDE_TORCH
        + """
import json
import compass_compat
after_import = "torch" in sys.modules
from mlx_vlm.utils import get_model_and_args
arch, _ = get_model_and_args({"model_type": "cohere_compass"})
print(json.dumps({"after_import": after_import, "after_load": "torch" in sys.modules, "file": arch.__file__}))
""",
        env={compass_compat.IMPLEMENTATION_ENV: SWITCH},
        cwd=Path("/"),
    )
    assert out["after_import"] is False and out["after_load"] is False
    assert kind_of(out["file"]) == DEFAULT_LIVE


# ------------------------------------------------------- the recorded verdicts


@pytest.mark.parametrize("damage", ["missing", "not json", "no releases", "a verdict of MAYBE"])
def test_a_missing_or_corrupt_record_is_refused_by_name(unpatched, monkeypatch, tmp_path, damage):
    """The record decides which cohere_compass is live: never a silent fallback when it is damaged."""
    from compass_compat import verdicts

    bad = tmp_path / "verdicts.json"
    record = json.loads(verdicts.FILE.read_text(encoding="utf-8"))
    if damage == "not json":
        bad.write_text("{not json")
    elif damage == "no releases":
        bad.write_text(json.dumps({"items": record["items"]}))
    elif damage == "a verdict of MAYBE":
        release = next(iter(record["releases"]))
        record["releases"][release]["upstream"]["2"] = "MAYBE"
        bad.write_text(json.dumps(record))
    monkeypatch.setattr(verdicts, "FILE", bad)
    before = shim_state()
    with pytest.raises(CompassCompatError, match=str(bad)):
        apply_patch()
    assert shim_state() == before


def test_a_release_with_no_record_gets_the_vendored_package_and_says_how_to_record_one(tmp_path):
    """mlx-vlm reporting a version the record has never seen (or one that does not parse)."""
    from compass_compat import verdicts

    for release in ("0.99.1", "not-a-version"):
        live, verdict = verdicts.live_for(release, upstream_ships=True)
        assert live == "vendored" and verdict is not None and not verdict.recorded
        assert f"no verdict recorded for mlx-vlm {release}" in verdict.describe()
        assert f"pin_bump.sh {release}" in verdict.describe()


def test_the_rule_takes_upstream_only_where_every_item_passes(tmp_path):
    from compass_compat import verdicts

    record = json.loads(verdicts.FILE.read_text(encoding="utf-8"))
    entry = next(iter(record["releases"].values()))
    passing = {**entry, "upstream": dict.fromkeys(entry["upstream"], "PASS")}
    failing = {**entry, "upstream": {**passing["upstream"], "11": "FAIL"}}
    record["releases"] = {"9.0.0": passing, "9.0.1": failing}
    path = tmp_path / "verdicts.json"
    path.write_text(json.dumps(record))
    assert verdicts.live_for("9.0.0", True, path)[0] == "upstream"
    live, verdict = verdicts.live_for("9.0.1", True, path)
    assert live == "vendored" and verdict.failing == ((11, record["items"]["11"]),)
    assert verdicts.live_for("9.0.0", False, path) == ("vendored", None)
