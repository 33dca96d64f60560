"""Train the toy checkpoint (compass_data/toy_shapes) and record its reference answers.

The tiny cohere_compass (compass_data.toy.toy_config: the default tiny checkpoint's config
with a wider vision tower) is trained with transformers' reference model
(``CohereCompassForConditionalGeneration``) on CPU, on synthetic pictures drawn by
compass_data.shapes (sizes 128-448 px, square or not, hard or anti-aliased edges, tints,
noise, JPEG), in stages. A stage starts from transformers' own initialisation or (``--init``)
from a folder's weights and provenance, and runs:

1. a vision phase (``--vision-steps``): the tower alone, with throw-away linear heads on its
   image tokens that read the kind, colour and box of the shape under each token;
2. a joint phase (``--steps``): each step a batch of pictures of one size, each with one
   question of a random kind (``--kind-weights``), loss on the answer tokens and the end-of-turn
   token; with ``--tower train`` the tower learns too and the heads' loss is added
   (``AUX_WEIGHT``); with ``--tower frozen`` it is kept as it is. Every ``TEXT_EVERY``-th step
   a batch of the text-only prompts.

The heads are not part of the checkpoint. Seeded and deterministic
(``torch.use_deterministic_algorithms``, one thread); the record (provenance.json) keeps every
stage's command, settings, curves and greedy exact-match accuracy on held-out pictures
(``EVAL_SEED``, both renderers).

Needs the reference environment (torch + transformers >= 5.21):

    .venvs/mlxvlm-0.7.10/bin/python scripts/toy/train.py [--init DIR] ...   # a stage, then record
    .venvs/mlxvlm-0.7.10/bin/python scripts/toy/train.py --record           # record only

Writes compass_data/toy_shapes/{model.safetensors,provenance.json} and
tests/fixtures/toy_reference.json: transformers' greedy answers (text and ids) on the committed
weights loaded from a written checkpoint folder, for every question about the test pictures
(``TEST_SEED``: ``TEST_PICTURES`` per size bucket and renderer), every text-only prompt and the
demo picture. The tests compare MLX against that file on every pin.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from compass_data import shapes, toy
from scripts.toy import scoring
from tests.support import reference as _reference
from tests.support.toy_reference import MAX_NEW_TOKENS, Reference, decode, greedy

ROOT = pathlib.Path(__file__).resolve().parents[2]
REFERENCE_FILE = ROOT / "tests" / "fixtures" / "toy_reference.json"


def _portable(arg: str) -> str:
    """A command-line argument as the record keeps it: the record ships, so no absolute paths."""
    return os.path.relpath(arg, ROOT) if os.path.isabs(arg) else arg


SEED = 0  # torch's initialisation and the order of question kinds
THREADS = 1  # one thread: OpenMP threads stall when the cores are shared
STEPS = 3000
BATCH = 24
LR = 3e-3
WARMUP = 200
TEXT_EVERY = 20
VISION_LR_SCALE = 1.0  # in the joint phase (the tower has had its own phase)
KIND_WEIGHTS = (0.35, 0.1, 0.3, 0.25)  # describe, count, colour, where: counting is learnt first
# The vision phase: the tower alone, told per image token which kind and colour of shape it
# covers and that shape's box (heads thrown away after training). Without it the tower read
# colours but not kinds, and the answers guessed. The heads stay on, weighted, in the joint phase.
VISION_STEPS = 2000
VISION_LR = 3e-3
AUX_WEIGHT = 0.5
AUX_MIN_SHARE = 0.025  # a token belongs to the shape that covers most of it, if at least this share
BOX_LOSS_SCALE = 5.0
EVAL_PICTURES = 24  # per renderer
TEST_PICTURES = 10  # per size bucket and renderer
WIDE_SEED = [3, 320, 192]  # the 320 x 192 picture of the --draw-boxes test
TOWER_MODES = ("train", "frozen")


def build_model(config: dict):
    import torch
    from transformers import CohereCompassConfig, CohereCompassForConditionalGeneration

    torch.manual_seed(SEED)
    model = CohereCompassForConditionalGeneration(CohereCompassConfig(**config))
    return model.float()


def batch_inputs(ref: Reference, items: List[tuple]):
    """Model inputs for (prompt, answer, pixels or None) items, right-padded; labels only on
    the answers. Items are all text-only or all with a picture."""
    import torch

    with_image = items[0][2] is not None
    tokens: List[Optional[int]] = [None] * len(items)
    if with_image:
        pixel_values, grid = ref.pixels([pixels for _, _, pixels in items])
        tokens = [int(np.prod(ref.token_grid(row))) for row in grid]
    rows = [ref.prompt_ids(prompt, n, answer) for (prompt, answer, _), n in zip(items, tokens)]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, n_answer) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(ids) - n_answer : len(ids)] = torch.tensor(ids[-n_answer:])
    inputs = dict(input_ids=input_ids, labels=labels)
    if with_image:
        inputs.update(
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == ref.image_token_id).long(),
        )
    return inputs


def training_pictures(rng: np.random.Generator, count: int, elongated: bool = False):
    """(scenes, pixels) of ``count`` pictures of one random size, each with its own look;
    ``elongated``: one side at least twice the other."""
    size = elongated_size(rng) if elongated else shapes.random_size(rng)
    scenes = [shapes.random_scene(rng, size) for _ in range(count)]
    return scenes, [shapes.render(scene, shapes.random_look(rng)) for scene in scenes]


def is_elongated(size: Sequence[int]) -> bool:
    """One side at least twice the other."""
    return max(size) >= 2 * min(size)


def elongated_size(rng: np.random.Generator) -> tuple:
    """A size whose longer side (256-448 px) is at least twice the shorter (128 px up): rare
    in ``shapes.random_size``, and where stage 9's held-out boxes missed most (4 of 9 such
    pictures per renderer at 320-448 px, against 0-1 of 71 for the others)."""
    longer = int(rng.integers(2 * shapes.MIN_SIDE, shapes.MAX_SIDE + 1))
    shorter = int(rng.integers(shapes.MIN_SIDE, longer // 2 + 1))
    return (longer, shorter) if rng.random() < 0.5 else (shorter, longer)


# ----------------------------------------------------------------------------- per-token targets
def token_targets(scene, rows: int, cols: int):
    """Per image token (row-major over the ``rows x cols`` merged grid, the order the tower
    emits them): the kind (0 background, else 1 + index in ``shapes.KINDS``), the colour
    (likewise over ``shapes.COLOURS``) and the box (shares of width and height) of the shape
    covering most of the token's area of the picture."""
    width, height = scene.size
    # Which token cell each pixel falls in (the processor resizes the picture onto the grid).
    row_of = np.minimum((np.arange(height) + 0.5) * rows // height, rows - 1).astype(int)
    col_of = np.minimum((np.arange(width) + 0.5) * cols // width, cols - 1).astype(int)
    cell = (row_of[:, None] * cols + col_of[None, :]).reshape(-1)
    area = np.bincount(cell, minlength=rows * cols)
    kind = np.zeros(rows * cols, np.int64)
    colour = np.zeros(rows * cols, np.int64)
    box = np.zeros((rows * cols, 4), np.float32)
    best = np.zeros(rows * cols)
    for shape in scene.shapes:
        share = (
            np.bincount(cell, weights=shapes.shape_mask(shape, scene.size).reshape(-1), minlength=rows * cols) / area
        )
        mine = (share > best) & (share >= AUX_MIN_SHARE)
        kind[mine] = 1 + shapes.KINDS.index(shape.kind)
        colour[mine] = 1 + list(shapes.COLOURS).index(shape.colour)
        box[mine] = np.array(shapes.pixel_box(shape), np.float32) / np.array([width, height] * 2, np.float32)
        best = np.maximum(best, share)
    return kind, colour, box


class AuxHeads:
    """Linear heads on the tower's merged tokens (training only): kind, colour, box."""

    def __init__(self, width: int):
        import torch

        torch.manual_seed(SEED + 1)
        self.modules = torch.nn.ModuleDict(
            dict(
                kind=torch.nn.Linear(width, 1 + len(shapes.KINDS)),
                colour=torch.nn.Linear(width, 1 + len(shapes.COLOURS)),
                box=torch.nn.Linear(width, 4),
            )
        )

    def loss(self, tokens, scenes, ref: Reference, grid):
        """(loss, {kind and colour accuracy over shape tokens, mean box error in shares of the
        picture})."""
        import torch
        import torch.nn.functional as F

        targets = [token_targets(scene, *ref.token_grid(row)) for scene, row in zip(scenes, grid)]
        kind, colour, box = (torch.from_numpy(np.concatenate([t[i] for t in targets])) for i in range(3))
        if tokens.shape[0] != kind.shape[0]:
            raise AssertionError(f"{tokens.shape[0]} image tokens for {kind.shape[0]} targets")
        shape_tokens = kind > 0
        kind_logits, colour_logits = self.modules["kind"](tokens), self.modules["colour"](tokens)
        box_pred = self.modules["box"](tokens)[shape_tokens]
        loss = F.cross_entropy(kind_logits, kind) + F.cross_entropy(colour_logits, colour)
        loss = loss + BOX_LOSS_SCALE * F.smooth_l1_loss(box_pred, box[shape_tokens], beta=0.01)
        with torch.no_grad():
            stats = {
                "kind_accuracy": float((kind_logits.argmax(-1) == kind)[shape_tokens].float().mean()),
                "colour_accuracy": float((colour_logits.argmax(-1) == colour)[shape_tokens].float().mean()),
                "box_error": float((box_pred - box[shape_tokens]).abs().mean()),
            }
        return loss, stats


def train_vision(model, ref: Reference, heads: AuxHeads, steps: int, seed) -> list:
    """The vision phase: the tower and the heads alone, on pictures from ``seed``."""
    import torch

    visual = model.model.visual
    params = list(visual.parameters()) + list(heads.modules.parameters())
    opt = torch.optim.AdamW(params, lr=VISION_LR, betas=(0.9, 0.98), weight_decay=0.01)
    rng = np.random.default_rng(seed)
    curve, window = [], []
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = VISION_LR * min(1.0, (step + 1) / WARMUP)
        scenes, arrays = training_pictures(rng, BATCH)
        pixel_values, grid = ref.pixels(arrays)
        loss, stats = heads.loss(visual(pixel_values, grid_thw=grid).pooler_output, scenes, ref, grid)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        window.append(dict(stats, loss=loss.item()))
        if (step + 1) % 50 == 0:
            point = {k: round(float(np.mean([w[k] for w in window])), 4) for k in window[0]}
            curve.append(dict(step=step + 1, **point, seconds=round(time.time() - start)))
            window = []
            print(f"vision step {step + 1}/{steps} {curve[-1]}", flush=True)
    return curve


def box_hit(text: str, question, size) -> bool:
    """Does the first box in ``text``, scaled to the picture's own width and height, overlap the
    named shape's exact extent with IoU >= 0.5?"""
    return scoring.box_hit(text, question.subject, size)


def score(answers: List[tuple]) -> dict:
    """Exact match and box hits of (example, kind, text) triples, per bucket and kind."""
    table: Dict[str, Dict[str, List[bool]]] = {}
    for example, kind, text in answers:
        q = example.questions[kind]
        hit = box_hit(text, q, example.scene.size) if kind == "where" else text == q.answer
        for bucket in ("all", shapes.bucket_of(example.scene.size)):
            table.setdefault(bucket, {}).setdefault(kind, []).append(hit)
    out = {}
    for bucket, kinds in sorted(table.items()):
        exact = [h for k, v in kinds.items() if k != "where" for h in v]
        out[bucket] = {
            "exact_match": round(float(np.mean(exact)), 4),
            **{k: round(float(np.mean(kinds[k])), 4) for k in shapes.QUESTION_KINDS if k in kinds},
            "pictures": len(kinds["count"]),
        }
    return out


def evaluate(model, ref: Reference, seed: int, count: int) -> dict:
    """Greedy exact match per question kind (``where``: box IoU >= 0.5) on ``count`` varied
    pictures from ``seed`` per renderer, and the text-only prompts."""
    import torch

    model.eval()
    out = {}
    with torch.no_grad():
        for renderer in shapes.RENDERERS:
            answers = []
            for example in shapes.examples([seed, shapes.RENDERERS.index(renderer)], count, renderer=renderer):
                pixels = example.pixels()
                for kind, q in example.questions.items():
                    answers.append((example, kind, decode(ref, greedy(model, ref, q.prompt, pixels))))
            out[renderer] = score(answers)
        text_hits = sum(decode(ref, greedy(model, ref, p, None)) == a for p, a in shapes.TEXT_ANSWERS.items())
    model.train()
    out["text_only"] = f"{text_hits}/{len(shapes.TEXT_ANSWERS)}"
    return out


# ----------------------------------------------------------------------------- head layout changes
def merged_head_slots(heads: int, old_pairs: int) -> list:
    """For each rotary pair of the one merged head: the (old head, old pair) it is taken from.

    Old pair i turned at base^(-2i / old head_dim), the frequency of merged pair ``heads * i``
    (the merged head has ``heads`` times the pairs, the same RoPE base): old head h's pair i goes
    to merged pair ``heads * i + h``, so head 0 keeps its frequencies exactly and each further
    head turns at the next merged frequency (x base^(-1 / merged head_dim) per step). The
    interleaved MRoPE sections then give some pairs another axis (t, h, w) than they had: on the
    toy's stage-13 weights this start's loss was lower than that of keeping every pair's axis
    (the nearest merged pair of its own axis: provenance, stage 14)."""
    return [(j % heads, j // heads) for j in range(heads * old_pairs)]


def merge_heads(state: dict, config: dict, from_heads: Sequence[int]) -> str:
    """Read ``state``'s text attention, trained as ``from_heads`` = (query heads, KV heads) of
    ``hidden_size // heads``, as the one head of ``hidden_size`` (one KV head) ``config`` has; in
    place. Returns what was done (for the provenance record).

    Each rotary pair (the two halves rotate_half pairs) of an old head keeps its values in q, k,
    v and o's columns, moved to the merged pair :func:`merged_head_slots` gives it; k and v
    are the old KV head's, once per old query head that read it, so the merged head's value
    rows and o's columns give each old head's output through its own o columns, and its scores
    are the old heads' scores summed; k is scaled by sqrt(new head_dim) / (heads x sqrt(old
    head_dim)) so that they are averaged at the new 1/sqrt(head_dim). Exact where the old heads
    attended alike, and in the sliding layers up to the pairs' frequency and axis shifts."""
    text = config["text_config"]
    hidden, heads, kv_heads = text["hidden_size"], int(from_heads[0]), int(from_heads[1])
    if text["num_attention_heads"] != 1 or text["num_key_value_heads"] != 1:
        raise SystemExit("--from-heads: only merging into one head (one KV head) is implemented")
    if heads < 2 or heads % kv_heads:
        raise SystemExit(f"--from-heads {heads} {kv_heads}: not a layout to merge")
    old_dim = hidden // heads
    old_pairs, pairs = old_dim // 2, hidden // 2
    slots = merged_head_slots(heads, old_pairs)
    # Row r of the merged head: its pair (r % pairs), first or second half (r // pairs).
    q_rows = [h * old_dim + i + half * old_pairs for half in (0, 1) for h, i in slots]
    kv_rows = [(h // (heads // kv_heads)) * old_dim + i + half * old_pairs for half in (0, 1) for h, i in slots]
    scale = math.sqrt(hidden) / (heads * math.sqrt(old_dim))
    prefix = "model.language_model.layers."
    layers = sorted({k.split(".")[3] for k in state if k.startswith(prefix)}, key=int)
    for n in layers:
        a = f"{prefix}{n}.self_attn."
        if tuple(state[a + "k_proj.weight"].shape) != (kv_heads * old_dim, hidden):
            raise SystemExit(
                f"{a}k_proj: shape {tuple(state[a + 'k_proj.weight'].shape)} is not {heads} heads of {old_dim}"
            )
        state[a + "q_proj.weight"] = state[a + "q_proj.weight"][q_rows].clone()
        state[a + "k_proj.weight"] = state[a + "k_proj.weight"][kv_rows] * scale
        state[a + "v_proj.weight"] = state[a + "v_proj.weight"][kv_rows].clone()
        state[a + "o_proj.weight"] = state[a + "o_proj.weight"][:, q_rows].clone()
    return (
        f"{heads} heads of {old_dim} ({kv_heads} KV head{'s' if kv_heads > 1 else ''}) merged into one head of {hidden} "
        f"(train.merge_heads): q_proj rows and o_proj columns of every old head kept, old head h's rotary pair i "
        f"(of {old_pairs}) moved to merged pair {heads}i+h (of {pairs}: head 0's frequencies exact, head 1's the next "
        f"merged frequency); k_proj and v_proj ({kv_heads * old_dim} -> {hidden} rows) the old KV head's rows once per query "
        f"head, in the same order, k scaled by sqrt({hidden}) / ({heads} x sqrt({old_dim})) = {scale:.4f} so the "
        "merged scores are the old heads' scores averaged"
    )


# ----------------------------------------------------------------------------- training
def train(
    steps: int,
    out_dir: Optional[pathlib.Path] = None,
    init: Optional[pathlib.Path] = None,
    lr: float = LR,
    kind_weights: Sequence[float] = KIND_WEIGHTS,
    vision_steps: Optional[int] = None,
    tower: str = "train",
    eval_pictures: int = EVAL_PICTURES,
    elongated: float = 0.0,
    from_heads: Optional[Sequence[int]] = None,
) -> dict:
    """One stage: train from transformers' initialisation, or from the weights in folder
    ``init`` (their provenance appended), and write weights and provenance. ``from_heads``:
    ``init``'s text attention was (query heads, KV heads) of another head_dim than
    :func:`compass_data.toy.toy_config` has now (:func:`merge_heads`)."""
    import torch
    import transformers

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    config = toy.toy_config()
    with tempfile.TemporaryDirectory() as tmp:
        # Only the tokenizer and processor files are read: any weights will do.
        folder = toy.tiny.write_checkpoint(pathlib.Path(tmp), config, toy.tiny.tiny_weights(0))
        ref = Reference(folder)
    model = build_model(config)
    previous: dict = {}
    config_change = None
    if from_heads is not None and init is None:
        raise SystemExit("--from-heads reads the weights of --init")
    if init is not None:
        from safetensors.torch import load_file

        state = load_file(str(init / toy.WEIGHTS_FILE.name))
        if from_heads is not None:
            text = config["text_config"]
            section = text["rope_parameters"]["sliding_attention"]["mrope_section"]
            config_change = (
                f"toy_config's text attention changed at this stage: {from_heads[0]} heads of "
                f"{text['hidden_size'] // from_heads[0]} ({from_heads[1]} KV) -> {text['num_attention_heads']} "
                f"head of {text['hidden_size'] // text['num_attention_heads']} ({text['num_key_value_heads']} KV), "
                f"MRoPE sections {[s // from_heads[0] for s in section]} -> {section}; "
                + merge_heads(state, config, from_heads)
            )
            print(config_change, flush=True)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if set(missing) != {"lm_head.weight"} or unexpected:  # the head is tied to the embedding
            raise SystemExit(f"{init}: not the toy's weights (missing {missing}, unexpected {unexpected})")
        previous = json.loads((init / toy.PROVENANCE_FILE.name).read_text())
    stage = len(previous.get("stages", [])) + 1
    if vision_steps is None:
        vision_steps = VISION_STEPS if init is None else 0
    if tower == "frozen" and vision_steps:
        raise SystemExit("--vision-steps trains the tower: it needs --tower train")
    model.train()
    heads, vision_curve, captured = None, [], {}
    if tower == "frozen":
        for param in model.model.visual.parameters():
            param.requires_grad_(False)
    else:
        heads = AuxHeads(config["vision_config"]["out_hidden_size"])
        vision_curve = train_vision(model, ref, heads, vision_steps, [shapes.TRAIN_SEED, stage, 0])
        model.model.visual.register_forward_hook(lambda _m, _a, out: captured.__setitem__("tokens", out.pooler_output))
    groups = []
    for visual in (False, True):
        named = [(n, p) for n, p in model.named_parameters() if (".visual." in f".{n}") == visual and p.requires_grad]
        scale = VISION_LR_SCALE if visual else 1.0
        matrices = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
        rest = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n)]
        groups += [
            {"params": matrices, "weight_decay": 0.01, "scale": scale},
            {"params": rest, "weight_decay": 0.0, "scale": scale},
        ]
    if heads is not None:
        groups.append({"params": list(heads.modules.parameters()), "weight_decay": 0.01, "scale": VISION_LR_SCALE})
    groups = [g for g in groups if g["params"]]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < WARMUP:
            return lr * (step + 1) / WARMUP
        progress = (step - WARMUP) / max(1, steps - WARMUP)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    # Each stage draws new pictures: stage k from [TRAIN_SEED, k] (stages 1-4, the 192 px
    # lattice pictures of toy v2, drew from TRAIN_SEED and [TRAIN_SEED, k]).
    picture_seed = [shapes.TRAIN_SEED, stage, 1]
    rng = np.random.default_rng(picture_seed)
    kind_rng = np.random.default_rng([SEED, stage])
    # Its own generator, so a stage without --elongated draws exactly the pictures it always did.
    elongated_seed = [SEED, stage, 2]
    elongated_rng = np.random.default_rng(elongated_seed)
    text_items = list(shapes.TEXT_ANSWERS.items())
    kind_p = np.divide(kind_weights, sum(kind_weights))
    curve, window, aux_window, pictures = [], [], [], 0
    by_kind: Dict[str, List[float]] = {k: [] for k in ("text",) + shapes.QUESTION_KINDS}
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step) * group["scale"]
        if step % TEXT_EVERY == TEXT_EVERY - 1:
            inputs = batch_inputs(ref, [(p, a, None) for p, a in text_items])
            kinds, scenes = ["text"] * len(text_items), []
        else:
            scenes, arrays = training_pictures(rng, BATCH, elongated_rng.random() < elongated)
            items, kinds = [], []
            for scene, pixels in zip(scenes, arrays):
                q = shapes.questions(scene, rng)[kind_rng.choice(shapes.QUESTION_KINDS, p=kind_p)]
                items.append((q.prompt, q.answer, pixels))
                kinds.append(q.kind)
            pictures += len(scenes)
            inputs = batch_inputs(ref, items)
        model.model.rope_deltas = None
        labels = inputs.pop("labels")[:, 1:]
        logits = model(**inputs).logits[:, :-1].float()
        per_token = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=-100, reduction="none"
        )
        counted = (labels != -100).sum(dim=1)
        loss = per_token.sum() / counted.sum()
        if scenes and heads is not None:
            aux_loss, aux_stats = heads.loss(captured.pop("tokens"), scenes, ref, inputs["image_grid_thw"])
            loss = loss + AUX_WEIGHT * aux_loss
            aux_window.append(aux_stats)
        for kind, row in zip(kinds, (per_token.sum(dim=1) / counted).tolist()):
            by_kind[kind].append(row)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(loss.item())
        if (step + 1) % 50 == 0:
            kind_loss = {k: round(float(np.mean(v)), 4) for k, v in by_kind.items() if v}
            curve.append(
                {
                    "step": step + 1,
                    "loss": round(float(np.mean(window)), 5),
                    "loss_per_kind": kind_loss,
                    "tokens": {  # none when the tower is frozen
                        k: round(float(np.mean([w[k] for w in aux_window])), 4) for k in (aux_window or [{}])[0]
                    },
                    "seconds": round(time.time() - start),
                }
            )
            window, aux_window = [], []
            by_kind = {k: [] for k in by_kind}
            print(
                f"step {step + 1}/{steps} loss {curve[-1]['loss']:.4f} {kind_loss} {curve[-1]['tokens']} "
                f"({curve[-1]['seconds']} s)",
                flush=True,
            )
    train_seconds = time.time() - start

    held_out = evaluate(model, ref, shapes.EVAL_SEED, eval_pictures) if eval_pictures else {}
    print(
        f"held-out ({eval_pictures} pictures per renderer, seed {shapes.EVAL_SEED}): {json.dumps(held_out)}", flush=True
    )
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    expected = set(toy.tiny.tiny_weights(0))
    if set(weights) != expected:
        raise SystemExit(f"trained keys differ from the tiny layout: {sorted(set(weights) ^ expected)}")
    out_dir = out_dir or toy.TOY_DIR
    weights_file, provenance_file = out_dir / toy.WEIGHTS_FILE.name, out_dir / toy.PROVENANCE_FILE.name
    out_dir.mkdir(parents=True, exist_ok=True)
    toy.tiny.save_safetensors(weights_file, weights)
    this = {
        "stage": stage,
        "command": " ".join(["scripts/toy/train.py"] + [_portable(arg) for arg in sys.argv[1:]]),
        "data": {
            "recipe": "compass_data.shapes: pictures of 128-448 px a side (square half the time; one size per "
            "batch), 1-3 shapes of distinct kinds (circle, square, triangle, star) in 4 colours (shaded +-12), "
            "cells 18-45% of the shorter side at continuous positions, no overlap; background tinted +-10; "
            "hard or anti-aliased edges (half each), Gaussian noise sd 1-6 on half, JPEG (Pillow) quality "
            f"{list(shapes.JPEG_QUALITIES)} on a third; drawn by shapes.render (numpy)"
            + (
                f"; {elongated:.0%} of the batches elongated (train_toy.elongated_size: longer side 256-448, "
                "at least twice the shorter)"
                if elongated
                else ""
            )
            + ". One question per picture, "
            f"its kind drawn with weights {dict(zip(shapes.QUESTION_KINDS, kind_weights))}; every "
            f"{TEXT_EVERY}th step the text-only prompts",
            "picture_seed": picture_seed,
            **({"elongated_share": elongated, "elongated_seed": elongated_seed} if elongated else {}),
            "training_pictures": pictures,
            "eval_seed": shapes.EVAL_SEED,
            "test_seed": shapes.TEST_SEED,
        },
        "init": f"transformers' own initialisation, torch.manual_seed({SEED})"
        if init is None
        else f"stage {stage - 1}'s weights (sha256 {previous.get('weights_sha256')})",
        "optimizer": f"AdamW lr {lr} (vision tower {'frozen' if tower == 'frozen' else f'x{VISION_LR_SCALE}'}) "
        f"betas (0.9, 0.98), weight decay 0.01 on matrices; {WARMUP} warm-up steps then cosine to 5%; "
        "gradient clip 1.0",
        "steps": steps,
        "batch": BATCH,
        "threads": THREADS,
        "seconds": round(train_seconds),
        "curve": curve,
        "held_out": held_out,
    }
    if config_change:
        this["config_change"] = config_change
    if vision_curve or heads is not None:
        this["vision_phase"] = {
            "what": "the vision tower alone, with linear heads on its merged tokens (thrown away after "
            "training) for the kind and colour of the shape covering most of each token (at least "
            f"{AUX_MIN_SHARE:.1%} of it) and that shape's box; the heads stay on in the joint phase, "
            f"loss weight {AUX_WEIGHT}; box loss smooth L1 x{BOX_LOSS_SCALE}",
            "picture_seed": [shapes.TRAIN_SEED, stage, 0],
            "optimizer": f"AdamW lr {VISION_LR}, {WARMUP} warm-up steps then constant; gradient clip 1.0",
            "steps": vision_steps,
            "batch": BATCH,
            "seconds": vision_curve[-1]["seconds"] if vision_curve else 0,
            "curve": vision_curve,
        }
    stages = previous.get("stages", []) + [this]
    record = {
        "what": "a TOY: the tiny cohere_compass trained on synthetic shape pictures, not North-Micro-Vision",
        "script": "scripts/toy/train.py",
        "stages": stages,
        "seconds_all_stages": sum(s.get("seconds", 0) + s.get("vision_phase", {}).get("seconds", 0) for s in stages),
        "held_out": held_out,
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "weights_sha256": toy.tiny.weights_sha256(weights),
        "weights_bytes": weights_file.stat().st_size,
    }
    provenance_file.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {weights_file} ({record['weights_bytes']} bytes) and {provenance_file}")
    return record


# ----------------------------------------------------------------------------- reference answers
def test_examples() -> List:
    """The test pictures: ``TEST_PICTURES`` per size bucket and renderer, from ``TEST_SEED``."""
    out = []
    for b, bucket in enumerate(shapes.BUCKETS.values()):
        for r, renderer in enumerate(shapes.RENDERERS):
            out += shapes.examples([shapes.TEST_SEED, b, r], TEST_PICTURES, bucket=bucket, renderer=renderer)
    return out


def record_reference() -> dict:
    """transformers' greedy answers on the committed toy weights, loaded from a checkpoint folder."""
    import transformers

    torch = _reference.deterministic_torch()
    with tempfile.TemporaryDirectory() as tmp:
        folder = toy.build_toy_checkpoint(pathlib.Path(tmp) / "toy")
        model = _reference.load_model(folder, "the toy checkpoint")
        ref = Reference(folder)
    pictures, text, scored = [], [], []
    with torch.no_grad():
        for b, bucket in enumerate(shapes.BUCKETS):
            for r, renderer in enumerate(shapes.RENDERERS):
                for example in shapes.examples(
                    [shapes.TEST_SEED, b, r], TEST_PICTURES, bucket=shapes.BUCKETS[bucket], renderer=renderer
                ):
                    pixels = example.pixels()
                    answers = {}
                    for kind, q in example.questions.items():
                        margins: List[float] = []
                        ids = greedy(model, ref, q.prompt, pixels, margins)
                        answers[kind] = {
                            "prompt": q.prompt,
                            "expected": q.answer,
                            "ids": ids,
                            "text": decode(ref, ids),
                            "min_margin": round(min(margins), 4),
                        }
                        scored.append((example, kind, answers[kind]["text"]))
                    pictures.append(
                        {
                            "seed": [shapes.TEST_SEED, b, r],
                            "bucket": bucket,
                            "renderer": renderer,
                            "index": example.index,
                            "size": list(example.scene.size),
                            "sha256": example.sha256(),
                            "answers": answers,
                        }
                    )
                print(f"recorded {bucket} {renderer}", flush=True)
        for prompt, expected in shapes.TEXT_ANSWERS.items():
            ids = greedy(model, ref, prompt, None)
            text.append({"prompt": prompt, "expected": expected, "ids": ids, "text": decode(ref, ids)})
        demo_pixels = shapes.render(shapes.DEMO_SCENE)
        demo = {}
        for kind, q in shapes.demo_questions().items():
            ids = greedy(model, ref, q.prompt, demo_pixels)
            demo[kind] = {"prompt": q.prompt, "expected": q.answer, "ids": ids, "text": decode(ref, ids)}
        rng = np.random.default_rng(WIDE_SEED)
        scene = shapes.random_scene(rng, (320, 192))
        q = shapes.questions(scene, rng)["where"]
        ids = greedy(model, ref, q.prompt, shapes.render(scene))
        wide = {"seed": WIDE_SEED, "size": [320, 192], "prompt": q.prompt, "expected": q.answer, "ids": ids}
        wide.update(text=decode(ref, ids), box_hit=box_hit(decode(ref, ids), q, scene.size))
    out = {
        "what": "transformers' greedy answers on the toy checkpoint (scripts/toy/train.py --record)",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "weights_sha256": toy.provenance()["weights_sha256"],
        "test_seed": shapes.TEST_SEED,
        "test_pictures_per_bucket_and_renderer": TEST_PICTURES,
        "max_new_tokens": MAX_NEW_TOKENS,
        "accuracy": {r: score([(e, k, t) for e, k, t in scored if e.renderer == r]) for r in shapes.RENDERERS},
        "pictures": pictures,
        "text_only": text,
        "demo": demo,
        "wide": wide,
    }
    REFERENCE_FILE.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {REFERENCE_FILE}: {json.dumps(out['accuracy'], indent=1)}")
    print(
        f"text-only {sum(t['text'] == t['expected'] for t in text)}/{len(text)}, "
        f"demo {[(d['text'], d['expected']) for d in demo.values()]}, wide {wide}"
    )
    return out


def load_trained(folder: pathlib.Path):
    """(reference model, :class:`Reference`) for the toy weights in ``folder``."""
    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as tmp:
        weights = load_file(str(folder / toy.WEIGHTS_FILE.name))
        checkpoint = toy.tiny.write_checkpoint(pathlib.Path(tmp), toy.toy_config(), weights)
        return _reference.load_model(checkpoint, f"the weights in {folder}"), Reference(checkpoint)


def find_demo(folder: pathlib.Path, count: int = 300) -> None:
    """Print the first 192 x 192 pictures of two or three shapes in distinct colours (seed 4,
    never used elsewhere) that the weights in ``folder`` answer right (exact text; the box with
    IoU >= 0.5), as ``shapes.Shape`` literals for ``DEMO_SCENE``."""
    torch = _reference.deterministic_torch()
    model, ref = load_trained(folder)
    found = 0
    with torch.no_grad():
        for example in shapes.examples(4, count, varied=False):
            scene = example.scene
            if len(scene.shapes) < 2 or len({s.colour for s in scene.shapes}) < len(scene.shapes):
                continue
            # Whole pixels and plain colours: a picture as simple to write down as to look at.
            scene = shapes.Scene(
                tuple(shapes.Shape(s.kind, s.colour, round(s.left), round(s.top), round(s.side)) for s in scene.shapes)
            )
            asked = shapes.demo_questions(scene)
            pixels = shapes.render(scene)
            got = {k: decode(ref, greedy(model, ref, q.prompt, pixels)) for k, q in asked.items()}
            exact = all(got[k] == q.answer for k, q in asked.items() if k != "where")
            if exact and box_hit(got["where"], asked["where"], scene.size):
                print(scene.shapes, got)
                found += 1
                if found == 3:
                    return


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="only record the reference answers")
    parser.add_argument("--steps", type=int, default=STEPS, help="joint training steps (default: %(default)s)")
    parser.add_argument(
        "--vision-steps", type=int, help=f"vision phase steps (default: {VISION_STEPS} from scratch, 0 with --init)"
    )
    parser.add_argument(
        "--tower", choices=TOWER_MODES, default="train", help="train the vision tower or keep it (default: %(default)s)"
    )
    parser.add_argument("--out", type=pathlib.Path, help="write the weights elsewhere and record nothing (trials)")
    parser.add_argument("--init", type=pathlib.Path, help="a further stage from this folder's weights and provenance")
    parser.add_argument("--lr", type=float, default=LR, help="peak learning rate (default: %(default)s)")
    parser.add_argument(
        "--kind-weights",
        type=float,
        nargs=4,
        default=KIND_WEIGHTS,
        metavar=("DESCRIBE", "COUNT", "COLOUR", "WHERE"),
        help="how often each question kind is asked (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-pictures", type=int, default=EVAL_PICTURES, help="held-out pictures per renderer (default: %(default)s)"
    )
    parser.add_argument(
        "--elongated",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of batches whose pictures have one side at least twice the other (default: %(default)s)",
    )
    parser.add_argument(
        "--from-heads",
        type=int,
        nargs=2,
        metavar=("HEADS", "KV_HEADS"),
        help="--init's text attention had these heads (merged into toy_config's one head: merge_heads)",
    )
    parser.add_argument("--no-record", action="store_true", help="train only (a stage that another follows)")
    parser.add_argument("--find-demo", type=pathlib.Path, help="print demo scenes these weights answer right")
    args = parser.parse_args(argv)
    if args.find_demo:
        return find_demo(args.find_demo)
    if not args.record:
        train(
            args.steps,
            args.out,
            args.init,
            args.lr,
            args.kind_weights,
            args.vision_steps,
            args.tower,
            args.eval_pictures,
            args.elongated,
            args.from_heads,
        )
    if args.out is None and not args.no_record:
        record_reference()


if __name__ == "__main__":
    main()
