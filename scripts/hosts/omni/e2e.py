#!/usr/bin/env python3
"""End to end: mlx-omni-server 0.5.3 (mlx-vlm 0.4.4) with compass-compat's opt-in, what a user gets.

Run it with the environment's interpreter (scripts/hosts/omni/env.sh builds it):

    .venvs/omni-0.5.3/bin/python scripts/hosts/omni/e2e.py [--max-tokens 12] [--source DIR]

(scripts/hosts/common/e2e.py does the setup, servers and report.) Unlike the other hosts, mlx-omni-server cannot serve the model as a VLM: it loads through mlx-vlm
only models whose type or name says gemma4 (`chat/mlx/model_types.py`, `MLX_VLM_ONLY_MODELS`,
`_is_vlm_model`) and sends every other model to `mlx_lm.load`, and its request schema
(`chat/openai/schema.py`, `ChatMessage.content: Union[str, List[Dict[str, str]]]`) refuses the
OpenAI picture part `{"type": "image_url", "image_url": {"url": ...}}`. So this run checks what
the documentation says a user gets, as observed facts, and exits 0 only when every one holds:

- phase `autopatch` (`COMPASS_COMPAT_AUTOPATCH=1` only): a text request gets HTTP 500 with
  "Model type cohere_compass not supported" in the server log; a picture request gets 422;
- phase `mlx_lm` (plus `COMPASS_COMPAT_MLX_LM=1`): the first text request equals
  `python -m compass_compat generate --no-image` for the same message; its prompt has one token
  more than the reference's (a second BOS: the host encodes the rendered template with
  `tokenizer.encode`, which adds one), and that token is the BOS; the same request sent twice
  more is answered as mlx-lm answers its prompt with the last token twice (the host's prompt
  cache, `chat/mlx/prompt_cache.py`), not as `generate` does; a picture part
  `image_url: {url}` gets 422; a picture part `image_url: "<data URI>"` (the string form its schema
  lets through) is answered from the text alone (same prompt tokens as the text without it);
- phase `gemma4_name` (`COMPASS_COMPAT_AUTOPATCH=1` only, the same checkpoint in a folder whose
  name ends in `-gemma4`, which the host's name rule sends to `mlx_vlm.load`): text equals
  `generate`, twice; a picture sent as `image_url: "<data URI>"` equals `generate` with it;
  `image_url: {url}` still gets 422; a streamed request gets no text (the host raises
  "Streaming is not yet supported for VLM-only models" after the 200);
- phase `control` (a random llama checkpoint, no opt-in, no compass-compat): the same request
  sent three times: the first answer is mlx-lm's for its prompt with the second BOS, the
  repeats mlx-lm's with the last prompt token twice, so both defects are the host's; each reply
  runs to max_tokens and lacks its last token's text (a third defect of the host's).

The host's startup imports three modules that cannot run here (text to speech and image
generation, off the chat path): scripts/hosts/omni/launch.py stubs them and starts the host's
own `mlx_omni_server.main.start`.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scripts.hosts.common.e2e import (  # noqa: E402
    FIXTURES,
    Case,
    Host,
    chat_body,
    data_uri,
    finish,
    log,
    post_chat,
    references,
    run_phase,
    setup,
    show,
)

NAME = "omni"
LAUNCH = Path(__file__).resolve().parent / "launch.py"
SEA = "Write one sentence about the sea, the wind and the sky at night."
SHAPE = "What shape is in the middle?"
PICTURE = str(FIXTURES / "synth_320x256.png")


HOST = Host(
    name=NAME,
    label="mlx-omni-server 0.5.3",
    distributions=["mlx-omni-server", "mlx", "mlx-vlm", "mlx-lm", "transformers"],
    command=lambda model_dir, port: [sys.executable, str(LAUNCH), "--host", "127.0.0.1", "--port", str(port)],
    ready_check=lambda reply: None,  # it lists the Hugging Face cache; models load per request
)


@dataclass
class Check:
    phase: str
    name: str
    what: str
    documented: str  # what docs/hosts.md says a user gets
    got: str = "-"
    holds: str = "NO"
    notes: List[str] = field(default_factory=list)


def picture_parts(text: str, as_string: bool) -> List[Dict[str, Any]]:
    uri = data_uri(PICTURE)
    part = {"type": "image_url", "image_url": uri if as_string else {"url": uri}}
    return [part, {"type": "text", "text": text}]


def prompt_ids(model_dir: Path, text: str) -> Dict[str, Any]:
    """The reference prompt (the chat template tokenized once) and what the host encodes.

    The host renders the template to a string (`chat/mlx/tools/chat_template.py`) and encodes it
    with mlx-lm's `TokenizerWrapper.encode` (`chat/mlx/chat_generator.py`, `generate_stream`),
    which adds the tokenizer's BOS in front of the one the template already has.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": text}]
    ref = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return {"ref": list(ref), "host": list(tok.encode(rendered)), "bos": tok.bos_token_id}


def mlx_lm_answers(model_dir: Path, host_ids: List[int], max_tokens: int) -> Dict[str, str]:
    """mlx-lm's greedy answers, in this process, to the prompts the host decodes from.

    "twice": the host's prompt with its last token repeated, what a repeated request decodes
    from (its prompt cache keeps all but the last prompt token and feeds that one again on top
    of a cache that still holds it, `chat/mlx/prompt_cache.py`, `get_prompt_cache`). "-1" keys:
    one token fewer, what the host returns for a reply cut at max_tokens (`generate_stream`
    stops on the response that carries the finish_reason, and with it its text).
    """
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    import compass_compat

    compass_compat.apply_patch(mlx_lm=True)  # a no-op for a llama: mlx-lm knows it
    model, tok = load(str(model_dir))
    prompts = {"host": host_ids, "twice": [*host_ids, host_ids[-1]]}
    return {
        f"{name}{suffix}": generate(model, tok, ids, max_tokens=n, sampler=make_sampler(0.0))
        for name, ids in prompts.items()
        for suffix, n in (("", max_tokens), ("-1", max_tokens - 1))
    }


def random_llama(model_dir: Path, out: Path) -> Path:
    """A random llama checkpoint with the toy's tokenizer: a model mlx-lm loads without compass-compat.

    Its weights are drawn, not trained; its answers only need to depend on the context.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    dst = out / "models" / "random-llama"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    vocab = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Wider than mlx's init, whose tiny model repeats one token whatever the context.
    weights = {k: v if "norm" in k else 0.2 * mx.random.normal(v.shape) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, dst / name)
    return dst


def main(argv: Optional[List[str]] = None) -> int:
    run = setup(HOST, argv)
    if run is None:
        return 2
    n = run.max_tokens
    model_dir = run.model_dir
    llama_dir = random_llama(model_dir, run.out)
    llama = mlx_lm_answers(llama_dir, prompt_ids(llama_dir, SEA)["host"], n)
    model = str(model_dir)
    run.env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(run.out / "hf-cache"))

    # The host's name rule (`_is_vlm_model`): a path that contains "gemma4" goes to mlx_vlm.load.
    named_dir = run.out / "models" / f"{model_dir.name}-gemma4"
    shutil.rmtree(named_dir, ignore_errors=True)
    shutil.copytree(model_dir, named_dir)
    asked = {
        SEA: Case("ref", [], SEA, ""),
        SHAPE: Case("ref", [], SHAPE, ""),
        PICTURE: Case("ref", [PICTURE], SHAPE, ""),
    }
    answers = references(run, list(asked.values()))
    reference: Dict[str, Optional[str]] = {}
    for key, case in asked.items():
        reference[key], err = answers[case.key()]
        if err:
            log(NAME, f"reference for {case.images} {case.text!r}: {err}")
            return 2
    ids = prompt_ids(model_dir, SEA)
    replayed = mlx_lm_answers(model_dir, ids["host"], n)["twice"]
    log(NAME, f"reference answers: {reference}; prompt of {SEA!r}: reference {len(ids['ref'])} tokens")

    checks: List[Check] = []
    phases: Dict[str, Dict[str, Any]] = {}

    def phase(
        name: str, steps: Callable[[Callable], None], env: Optional[Dict[str, str]] = None, opted_in: bool = True
    ) -> None:
        def with_send(server: Any, base_url: str) -> None:
            def send(payload: Dict[str, Any]) -> Dict[str, Any]:
                offset = server.log_size()
                reply = post_chat(base_url, payload, {})
                time.sleep(0.3)  # let the log catch up
                reply["log"] = server.log_since(offset)
                return reply

            steps(send)

        phases[name] = run_phase(run, name, with_send, env=env, opted_in=opted_in)

    def check(phase: str, name: str, what: str, documented: str, holds: bool, got: str, *notes: str) -> None:
        c = Check(phase, name, what, documented, got, "yes" if holds else "NO", [n for n in notes if n])
        checks.append(c)
        log(NAME, f"{phase}/{name}: {'holds' if holds else 'DOES NOT HOLD'}: got {got}")

    def reply_text(r: Dict[str, Any]) -> str:
        return f"HTTP error: {r['error'][:120]}" if r.get("error") else show(r.get("text"))

    def refuses_image_url(send: Callable, name: str, phase: str, check_name: str) -> None:
        r = send(chat_body(name, picture_parts(SHAPE, as_string=False), n))
        check(
            phase, check_name, "image_url {url} + text", "HTTP 422 (request schema)",
            (r.get("error") or "").startswith("HTTP 422"), reply_text(r),
        )  # fmt: skip

    def autopatch(send: Callable) -> None:
        r = send(chat_body(model, "Say hello.", n))
        said = "Model type cohere_compass not supported" in r["log"]
        check(
            "autopatch", "t1", "text", "HTTP 500; log: Model type cohere_compass not supported (mlx_lm.load)",
            (r.get("error") or "").startswith("HTTP 500") and said, reply_text(r),
            "log names mlx-lm's refusal" if said else "log does not name the refusal",
        )  # fmt: skip
        refuses_image_url(send, model, "autopatch", "p1")

    def mlx_lm(send: Callable) -> None:
        r1 = send(chat_body(model, SEA, n))
        check(
            "mlx_lm", "r1", "text, first request", f"= generate: {show(reference[SEA])}",
            not r1.get("error") and r1.get("text") == reference[SEA], reply_text(r1),
        )  # fmt: skip
        second_bos = ids["host"] == [ids["bos"], *ids["ref"]] and r1.get("prompt_tokens") == len(ids["ref"]) + 1
        check(
            "mlx_lm", "r1-bos", "its prompt", f"second BOS: {len(ids['ref']) + 1} prompt tokens, reference {len(ids['ref'])}",
            second_bos, f"{r1.get('prompt_tokens')} prompt tokens",
            f"host encodes {ids['host'][:3]}..., reference {ids['ref'][:3]}...",
        )  # fmt: skip
        answers = [send(chat_body(model, SEA, n)) for _ in range(2)]
        texts = [a.get("text") for a in answers]
        check(
            "mlx_lm", "r2-r3", "= r1, sent twice more",
            f"answered from its prompt with the last token twice: {show(replayed)}",
            replayed != reference[SEA] and texts == [replayed, replayed], " / ".join(reply_text(a) for a in answers),
            f"prompt tokens cached: {[(a.get('cached_tokens'), a.get('prompt_tokens')) for a in answers]}",
        )  # fmt: skip
        refuses_image_url(send, model, "mlx_lm", "p1")
        with_picture = send(chat_body(model, picture_parts(SHAPE, as_string=True), n))
        text_only = send(chat_body(model, [{"type": "text", "text": SHAPE}], n))
        dropped = (
            not with_picture.get("error")
            and not text_only.get("error")
            and with_picture.get("prompt_tokens") == text_only.get("prompt_tokens")
        )
        check(
            "mlx_lm", "p2", 'image_url "<data URI>" + text', "200, the picture dropped (prompt tokens = the text's alone)",
            dropped, reply_text(with_picture),
            f"prompt tokens {with_picture.get('prompt_tokens')} with the picture, {text_only.get('prompt_tokens')} without",
            "= generate without the picture" if with_picture.get("text") == reference[SHAPE] else "",
        )  # fmt: skip

    def control(send: Callable) -> None:
        answers = [send(chat_body(str(llama_dir), SEA, n)) for _ in range(3)]
        texts = [a.get("text") for a in answers]
        cut = llama["host"] != llama["host-1"]  # the reply ran to max_tokens: its last token shows
        check(
            "control", "c1-c3", "random llama, text sent 3 times",
            "c1 = mlx-lm on its prompt (second BOS); c2, c3 = the same with the last prompt token twice;"
            " each less its last token (cut at max_tokens)",
            cut and texts == [llama["host-1"], llama["twice-1"], llama["twice-1"]],
            " / ".join(reply_text(a) for a in answers),
            f"mlx-lm, {n} tokens: {llama['host']!r} / {llama['twice']!r}",
        )  # fmt: skip

    def gemma4_name(send: Callable) -> None:
        named = str(named_dir)
        answers = [send(chat_body(named, SEA, n)) for _ in range(2)]
        check(
            "gemma4_name", "g1-g2", "text, sent twice", f"= generate both times: {show(reference[SEA])}, {len(ids['ref'])} prompt tokens",
            [a.get("text") for a in answers] == [reference[SEA]] * 2 and answers[0].get("prompt_tokens") == len(ids["ref"]),
            " / ".join(reply_text(a) for a in answers), f"prompt tokens {[a.get('prompt_tokens') for a in answers]}",
        )  # fmt: skip
        r = send(chat_body(named, picture_parts(SHAPE, as_string=True), n))
        check(
            "gemma4_name", "g3", 'image_url "<data URI>" + text', f"= generate with the picture: {show(reference[PICTURE])}",
            not r.get("error") and r.get("text") == reference[PICTURE], reply_text(r), f"{r.get('prompt_tokens')} prompt tokens",
        )  # fmt: skip
        refuses_image_url(send, named, "gemma4_name", "g4")
        r = send(chat_body(named, SEA, n, stream=True))
        refused = "Streaming is not yet supported for VLM-only models" in r["log"]
        check(
            "gemma4_name", "g5", "text, streamed", "no text (the stream ends without [DONE]; log: streaming not supported)",
            not r.get("text") and bool(r.get("error")) and refused, reply_text(r),
        )  # fmt: skip

    phase("autopatch", autopatch)
    phase("mlx_lm", mlx_lm, {"COMPASS_COMPAT_MLX_LM": "1"})
    phase("gemma4_name", gemma4_name)
    phase("control", control, opted_in=False)
    for name in ("mlx_lm", "gemma4_name"):  # the phases that load the model
        if not phases[name]["probe_ok"]:
            for c in checks:
                if c.phase == name:
                    c.holds = "NO"
                    c.notes.append("probe: " + phases[name]["probe"])

    rows = [("host", "check", "documented", "got", "holds", "notes")]
    rows += [(NAME, f"{c.phase}/{c.name} {c.what}", c.documented, c.got, c.holds, "; ".join(c.notes)) for c in checks]
    bad = [f"{c.phase}/{c.name}" for c in checks if c.holds != "yes"]
    summary = (
        f"{NAME}: {len(checks) - len(bad)} of {len(checks)} checks as documented (first text requests equal"
        f" `generate`, the host's defects seen)" + (f"; not as documented: {', '.join(bad)}" if bad else "")
    )
    checked = [asdict(c) for c in checks]
    return finish(run, phases, rows, bad, summary, reference=reference, prompt_ids=ids, checks=checked)


if __name__ == "__main__":
    sys.exit(main())
