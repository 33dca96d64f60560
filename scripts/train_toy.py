"""Train the toy checkpoint (compass_compat/data/toy_shapes) and record its reference answers.

The tiny cohere_compass (compass_compat.toy.toy_config: the default tiny checkpoint's config
with a wider vision tower) is trained from transformers' own initialisation with transformers'
reference model (``CohereCompassForConditionalGeneration``) on CPU, on synthetic pictures drawn
by compass_compat.shapes from ``TRAIN_SEED``, in two phases:

1. vision: the tower alone, with throw-away linear heads on its image tokens that read the kind,
   colour and box of the shape under each token (``VISION_STEPS``);
2. joint: the whole model, each step a batch of pictures, each with one question of a random
   kind, loss on the answer tokens and the end-of-turn token plus the heads' loss
   (``AUX_WEIGHT``); every ``TEXT_EVERY``-th step a batch of the text-only prompts.

The heads are not part of the checkpoint. Seeded and deterministic
(``torch.use_deterministic_algorithms``, a fixed thread count); the record keeps the loss curve
and the greedy exact-match accuracy on held-out pictures (``EVAL_SEED``).

Needs the reference environment (torch + transformers >= 5.21):

    .venvs/mlxvlm-0.7.10/bin/python scripts/train_toy.py            # train, then record
    .venvs/mlxvlm-0.7.10/bin/python scripts/train_toy.py --record   # record only

Writes compass_compat/data/toy_shapes/{model.safetensors,provenance.json} and
tests/fixtures/toy_reference.json: transformers' greedy answers (text and ids) on the committed
weights loaded from a written checkpoint folder, for every question about the ``TEST_SEED``
pictures and every text-only prompt. The tests compare MLX against that file on every pin.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import _reference  # scripts/_reference.py
import _unpatched  # scripts/_unpatched.py
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE_FILE = ROOT / "tests" / "fixtures" / "toy_reference.json"


shapes, toy, boxes = (_unpatched.module(m) for m in ("shapes", "toy", "boxes"))  # the reference runs unpatched

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
AUX_MIN_PIXELS = 24  # a token belongs to the shape that covers most of it, if at least this much
BOX_LOSS_SCALE = 5.0
EVAL_PICTURES = 50
MAX_NEW_TOKENS = 28
N_TEST_PICTURES = 50


# ----------------------------------------------------------------------------- reference parts
class Reference:
    """Tokenizer, chat template and PIL image processor of a checkpoint folder, as transformers
    builds them (the pixel bounds merged in, as CohereCompassProcessor does)."""

    def __init__(self, folder: pathlib.Path):
        self.tokenizer, self.image_processor = _reference.tokenizer_and_image_processor(
            folder, with_tokenizer_bounds=True
        )
        config = json.loads((folder / "config.json").read_text())
        self.image_token_id = config["image_token_id"]
        self.eos_id = config["eos_token_id"]

    def prompt_ids(self, prompt: str, with_image: bool, answer: Optional[str] = None):
        """(input ids, number of answer ids at the end): the chat template rendered, the image
        pad expanded to the picture's token count, the answer and its end of turn appended."""
        content = [{"type": "image"}, {"type": "text", "text": prompt}] if with_image else prompt
        messages = [{"role": "user", "content": content}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if with_image:
            side = shapes.SIZE // self.image_processor.patch_size // self.image_processor.merge_size
            text = text.replace("<|IMAGE_PAD|>", "<|IMAGE_PAD|>" * (side * side))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if answer is None:
            return ids, 0
        tail = self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.eos_id]
        return ids + tail, len(tail)

    def pixels(self, arrays: Sequence[np.ndarray]):
        from PIL import Image

        out = self.image_processor(images=[Image.fromarray(a) for a in arrays], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]


def build_model(config: dict):
    import torch
    from transformers import CohereCompassConfig, CohereCompassForConditionalGeneration

    torch.manual_seed(SEED)
    model = CohereCompassForConditionalGeneration(CohereCompassConfig(**config))
    return model.float()


def batch_inputs(ref: Reference, items: List[tuple], with_image: bool):
    """Model inputs for (prompt, answer, pixels) items, right-padded; labels only on answers."""
    import torch

    rows = [ref.prompt_ids(prompt, with_image, answer) for prompt, answer, _ in items]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, n_answer) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(ids) - n_answer : len(ids)] = torch.tensor(ids[-n_answer:])
    inputs = dict(input_ids=input_ids, labels=labels)
    if with_image:
        pixel_values, grid = ref.pixels([pixels for _, _, pixels in items])
        inputs.update(
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == ref.image_token_id).long(),
        )
    return inputs


# ----------------------------------------------------------------------------- per-token targets
def token_targets(scene, token: int):
    """Per image token (row-major over the merged grid, the order the tower emits them): the kind
    (0 background, else 1 + index in ``shapes.KINDS``), the colour (likewise over
    ``shapes.COLOURS``) and the pixel box / size of the shape covering most of the token."""
    side = shapes.SIZE // token
    kind = np.zeros(side * side, np.int64)
    colour = np.zeros(side * side, np.int64)
    box = np.zeros((side * side, 4), np.float32)
    best = np.zeros(side * side)
    for shape in scene.shapes:
        covered = shapes.shape_mask(shape).reshape(side, token, side, token).sum(axis=(1, 3)).reshape(-1)
        mine = (covered > best) & (covered >= AUX_MIN_PIXELS)
        kind[mine] = 1 + shapes.KINDS.index(shape.kind)
        colour[mine] = 1 + list(shapes.COLOURS).index(shape.colour)
        box[mine] = np.array(shapes.pixel_box(shape), np.float32) / shapes.SIZE
        best = np.maximum(best, covered)
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

    def loss(self, tokens, scenes, token: int):
        """(loss, {kind and colour accuracy over shape tokens, mean box error in pixels})."""
        import torch
        import torch.nn.functional as F

        targets = [token_targets(scene, token) for scene in scenes]
        kind, colour, box = (torch.from_numpy(np.concatenate([t[i] for t in targets])) for i in range(3))
        if tokens.shape[0] != kind.shape[0]:
            raise AssertionError(f"{tokens.shape[0]} image tokens for {kind.shape[0]} targets")
        shape_tokens = kind > 0
        kind_logits, colour_logits = self.modules["kind"](tokens), self.modules["colour"](tokens)
        box_pred = self.modules["box"](tokens)[shape_tokens]
        loss = F.cross_entropy(kind_logits, kind) + F.cross_entropy(colour_logits, colour)
        loss = loss + BOX_LOSS_SCALE * F.smooth_l1_loss(box_pred, box[shape_tokens], beta=0.02)
        with torch.no_grad():
            stats = {
                "kind_accuracy": float((kind_logits.argmax(-1) == kind)[shape_tokens].float().mean()),
                "colour_accuracy": float((colour_logits.argmax(-1) == colour)[shape_tokens].float().mean()),
                "box_error_pixels": float((box_pred - box[shape_tokens]).abs().mean() * shapes.SIZE),
            }
        return loss, stats


def token_size(ref: "Reference") -> int:
    return ref.image_processor.patch_size * ref.image_processor.merge_size


def train_vision(model, ref: "Reference", heads: AuxHeads, steps: int) -> list:
    """The vision phase: the tower and the heads alone, on pictures from ``[TRAIN_SEED, 0]``."""
    import torch

    visual = model.model.visual
    params = list(visual.parameters()) + list(heads.modules.parameters())
    opt = torch.optim.AdamW(params, lr=VISION_LR, betas=(0.9, 0.98), weight_decay=0.01)
    rng = np.random.default_rng([shapes.TRAIN_SEED, 0])
    curve, window = [], []
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = VISION_LR * min(1.0, (step + 1) / WARMUP)
        scenes = [shapes.random_scene(rng) for _ in range(BATCH)]
        pixel_values, grid = ref.pixels([shapes.render(scene) for scene in scenes])
        loss, stats = heads.loss(visual(pixel_values, grid_thw=grid).pooler_output, scenes, token_size(ref))
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


# ----------------------------------------------------------------------------- greedy decoding
def greedy(
    model, ref: Reference, prompt: str, pixels: Optional[np.ndarray], margins: Optional[List[float]] = None
) -> List[int]:
    """The reference's greedy answer ids (cached decode, stops after end of turn); ``margins``
    collects each step's top-1 minus top-2 logit."""
    import torch

    ids, _ = ref.prompt_ids(prompt, pixels is not None)
    input_ids = torch.tensor([ids])
    extra = {}
    if pixels is not None:
        pixel_values, grid = ref.pixels([pixels])
        extra = dict(
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == ref.image_token_id).long(),
        )
    model.model.rope_deltas = None
    out = model(input_ids=input_ids, use_cache=True, **extra)
    answer: List[int] = []
    for _ in range(MAX_NEW_TOKENS):
        logits = out.logits[0, -1]
        token = int(logits.argmax())
        if margins is not None:
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
        answer.append(token)
        if token == ref.eos_id:
            break
        out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return answer


def decode(ref: Reference, ids: List[int]) -> str:
    return ref.tokenizer.decode(ids, skip_special_tokens=True)


def evaluate(model, ref: Reference, seed: int, count: int) -> dict:
    """Greedy exact match per question kind (and box IoU) on ``count`` pictures from ``seed``."""
    import torch

    model.eval()
    hits: Dict[str, int] = {k: 0 for k in shapes.QUESTION_KINDS}
    ious = []
    with torch.no_grad():
        for example in shapes.examples(seed, count):
            pixels = example.pixels()
            for kind, q in example.questions.items():
                got = decode(ref, greedy(model, ref, q.prompt, pixels))
                hits[kind] += got == q.answer
                if kind == "where":
                    ious.append(box_iou(got, q.answer))
        text_hits = sum(decode(ref, greedy(model, ref, p, None)) == a for p, a in shapes.TEXT_ANSWERS.items())
    model.train()
    exact = sum(hits[k] for k in ("describe", "count", "colour"))
    return {
        "exact_match": round(exact / (3 * count), 4),
        "per_kind": {k: round(v / count, 4) for k, v in hits.items()},
        "box_iou_at_least_0.5": round(float(np.mean([v >= 0.5 for v in ious])), 4),
        "text_only": f"{text_hits}/{len(shapes.TEXT_ANSWERS)}",
    }


def box_iou(text: str, expected: str) -> float:
    """IoU of the first box in ``text`` with the box in ``expected`` (0 if either has none),
    boxes read as compass_compat.boxes reads them."""
    got, want = boxes.find_boxes(text), boxes.find_boxes(expected)
    return boxes.iou(got[0], want[0]) if got and want else 0.0


# ----------------------------------------------------------------------------- training
def train(
    steps: int,
    out_dir: Optional[pathlib.Path] = None,
    init: Optional[pathlib.Path] = None,
    lr: float = LR,
    kind_weights: Sequence[float] = KIND_WEIGHTS,
) -> dict:
    """Train (from transformers' initialisation, or from the weights in folder ``init``: a further
    stage on new pictures with the vision tower frozen, its provenance appended) and write
    weights and provenance."""
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
    if init is not None:
        from safetensors.torch import load_file

        missing, unexpected = model.load_state_dict(load_file(str(init / toy.WEIGHTS_FILE.name)), strict=False)
        if set(missing) != {"lm_head.weight"} or unexpected:  # the head is tied to the embedding
            raise SystemExit(f"{init}: not the toy's weights (missing {missing}, unexpected {unexpected})")
        previous = json.loads((init / toy.PROVENANCE_FILE.name).read_text())
    stage = len(previous.get("stages", [])) + 1
    model.train()
    # A further stage keeps the tower as trained: the heads that taught it are not kept.
    frozen_tower = init is not None
    heads, vision_curve, captured = None, [], {}
    if frozen_tower:
        for param in model.model.visual.parameters():
            param.requires_grad_(False)
    else:
        heads = AuxHeads(config["vision_config"]["out_hidden_size"])
        vision_curve = train_vision(model, ref, heads, VISION_STEPS)
        model.model.visual.register_forward_hook(lambda _m, _a, out: captured.__setitem__("tokens", out.pooler_output))
    vision_seconds = vision_curve[-1]["seconds"] if vision_curve else 0
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

    # Each stage draws new pictures: stage 1 from TRAIN_SEED, stage k from [TRAIN_SEED, k].
    rng = np.random.default_rng(shapes.TRAIN_SEED if stage == 1 else [shapes.TRAIN_SEED, stage])
    kind_rng = np.random.default_rng(SEED if stage == 1 else [SEED, stage])
    text_items = list(shapes.TEXT_ANSWERS.items())
    kind_p = np.divide(kind_weights, sum(kind_weights))
    curve, window, aux_window, seen = [], [], [], set()
    by_kind: Dict[str, List[float]] = {k: [] for k in ("text",) + shapes.QUESTION_KINDS}
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step) * group["scale"]
        if step % TEXT_EVERY == TEXT_EVERY - 1:
            inputs = batch_inputs(ref, [(p, a, None) for p, a in text_items], with_image=False)
            kinds = ["text"] * len(text_items)
            scenes = []
        else:
            items, kinds, scenes = [], [], []
            for _ in range(BATCH):
                scene = shapes.random_scene(rng)
                seen.add(scene)
                scenes.append(scene)
                q = shapes.questions(scene, rng)[kind_rng.choice(shapes.QUESTION_KINDS, p=kind_p)]
                items.append((q.prompt, q.answer, shapes.render(scene)))
                kinds.append(q.kind)
            inputs = batch_inputs(ref, items, with_image=True)
        model.model.rope_deltas = None
        labels = inputs.pop("labels")[:, 1:]
        logits = model(**inputs).logits[:, :-1].float()
        per_token = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=-100, reduction="none"
        )
        counted = (labels != -100).sum(dim=1)
        loss = per_token.sum() / counted.sum()
        if scenes and heads is not None:
            aux_loss, aux_stats = heads.loss(captured.pop("tokens"), scenes, token_size(ref))
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
                f"step {step + 1}/{steps} loss {curve[-1]['loss']:.4f} {kind_loss} ({curve[-1]['seconds']} s)",
                flush=True,
            )
    train_seconds = time.time() - start

    held_out = evaluate(model, ref, shapes.EVAL_SEED, EVAL_PICTURES)
    print(f"held-out ({EVAL_PICTURES} pictures, seed {shapes.EVAL_SEED}): {held_out}", flush=True)
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    expected = set(toy.tiny.tiny_weights(0))
    if set(weights) != expected:
        raise SystemExit(f"trained keys differ from the tiny layout: {sorted(set(weights) ^ expected)}")
    out_dir = out_dir or toy.TOY_DIR
    weights_file, provenance_file = out_dir / toy.WEIGHTS_FILE.name, out_dir / toy.PROVENANCE_FILE.name
    out_dir.mkdir(parents=True, exist_ok=True)
    toy.tiny.save_safetensors(weights_file, weights)
    test_scenes = {e.scene for e in shapes.examples(shapes.TEST_SEED, N_TEST_PICTURES)}
    record = {
        "what": "a TOY: the tiny cohere_compass trained on synthetic shape pictures, not North-Micro-Vision",
        "script": "scripts/train_toy.py",
        "command": " ".join(["scripts/train_toy.py"] + sys.argv[1:]),
        "data": {
            "recipe": "compass_compat.shapes: 192x192 pictures, 1-3 shapes of distinct kinds (circle, square, "
            "triangle, star), 4 colours, 8-pixel lattice, sides 48/64/80, no overlap; one question per picture, "
            f"its kind drawn with weights {dict(zip(shapes.QUESTION_KINDS, kind_weights))}; every "
            f"{TEXT_EVERY}th step the text-only prompts",
            "train_seed": shapes.TRAIN_SEED,
            "eval_seed": shapes.EVAL_SEED,
            "test_seed": shapes.TEST_SEED,
            "training_pictures": (steps - steps // TEXT_EVERY) * BATCH,
            "distinct_training_scenes": len(seen),
            "test_pictures_also_in_training": len(test_scenes & seen),
            "picture_seed": shapes.TRAIN_SEED if stage == 1 else [shapes.TRAIN_SEED, stage],
        },
        "training": {
            "stage": stage,
            "init": f"transformers' own initialisation, torch.manual_seed({SEED})"
            if init is None
            else f"stage {stage - 1}'s weights (sha256 {previous.get('weights_sha256')})",
            "optimizer": f"AdamW lr {lr} (vision tower {'frozen' if frozen_tower else f'x{VISION_LR_SCALE}'}) betas (0.9, 0.98), weight decay 0.01 "
            f"on matrices; {WARMUP} warm-up steps then cosine to 5%; gradient clip 1.0",
            "steps": steps,
            "batch": BATCH,
            "threads": THREADS,
            "seconds": round(train_seconds),
            "curve": curve,
            "vision_phase": {
                "what": "the vision tower alone, with linear heads on its merged tokens (thrown away after "
                "training) for the kind and colour of the shape covering most of each token (at least "
                f"{AUX_MIN_PIXELS} pixels) and that shape's pixel box; the heads stay on in the joint phase, "
                f"loss weight {AUX_WEIGHT}; box loss smooth L1 x{BOX_LOSS_SCALE}",
                "picture_seed": [shapes.TRAIN_SEED, 0],
                "optimizer": f"AdamW lr {VISION_LR}, {WARMUP} warm-up steps then constant; gradient clip 1.0",
                "steps": len(vision_curve) * 50,
                "batch": BATCH,
                "seconds": vision_seconds,
                "curve": vision_curve,
            },
        },
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
    this = {k: record[k] for k in ("command", "data", "training", "held_out")}
    record["stages"] = previous.get("stages", []) + [this]
    provenance_file.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {weights_file} ({record['weights_bytes']} bytes) and {provenance_file}")
    return record


# ----------------------------------------------------------------------------- reference answers
def record_reference() -> dict:
    """transformers' greedy answers on the committed toy weights, loaded from a checkpoint folder."""
    import transformers

    torch = _reference.deterministic_torch()
    with tempfile.TemporaryDirectory() as tmp:
        folder = toy.build_toy_checkpoint(pathlib.Path(tmp) / "toy")
        model = _reference.load_model(folder, "the toy checkpoint")
        ref = Reference(folder)
    pictures, text = [], []
    with torch.no_grad():
        for example in shapes.examples(shapes.TEST_SEED, N_TEST_PICTURES):
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
            pictures.append({"index": example.index, "sha256": example.sha256(), "answers": answers})
        for prompt, expected in shapes.TEXT_ANSWERS.items():
            ids = greedy(model, ref, prompt, None)
            text.append({"prompt": prompt, "expected": expected, "ids": ids, "text": decode(ref, ids)})
        demo_pixels = shapes.render(shapes.DEMO_SCENE)
        demo = {}
        for kind, q in shapes.demo_questions().items():
            ids = greedy(model, ref, q.prompt, demo_pixels)
            demo[kind] = {"prompt": q.prompt, "expected": q.answer, "ids": ids, "text": decode(ref, ids)}
    out = {
        "what": "transformers' greedy answers on the toy checkpoint (scripts/train_toy.py --record)",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "weights_sha256": toy.provenance()["weights_sha256"],
        "test_seed": shapes.TEST_SEED,
        "max_new_tokens": MAX_NEW_TOKENS,
        "pictures": pictures,
        "text_only": text,
        "demo": demo,
    }
    REFERENCE_FILE.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    exact = [a["text"] == a["expected"] for p in pictures for k, a in p["answers"].items() if k != "where"]
    ious = [box_iou(p["answers"]["where"]["text"], p["answers"]["where"]["expected"]) for p in pictures]
    print(
        f"wrote {REFERENCE_FILE}: exact match {np.mean(exact):.3f} on {len(exact)} questions, "
        f"box IoU >= 0.5 on {np.mean([v >= 0.5 for v in ious]):.3f}, "
        f"text-only {sum(t['text'] == t['expected'] for t in text)}/{len(text)}, "
        f"demo picture {sum(d['text'] == d['expected'] for d in demo.values())}/{len(demo)}"
    )
    return out


def find_demo(folder: pathlib.Path, count: int = 300) -> None:
    """Print the first pictures of two or three shapes in distinct colours (seed 4, never used
    elsewhere) that the weights in ``folder`` answer right (exact text; the box with IoU >= 0.5),
    as ``shapes.Shape`` literals for ``DEMO_SCENE``."""
    from safetensors.numpy import load_file

    torch = _reference.deterministic_torch()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = toy.tiny.write_checkpoint(
            pathlib.Path(tmp), toy.toy_config(), load_file(str(folder / toy.WEIGHTS_FILE.name))
        )
        model = _reference.load_model(checkpoint, f"the weights in {folder}")
        ref = Reference(checkpoint)
    found = 0
    with torch.no_grad():
        for example in shapes.examples(4, count):
            if len(example.scene.shapes) < 2 or len({s.colour for s in example.scene.shapes}) < len(
                example.scene.shapes
            ):
                continue
            asked = shapes.demo_questions(example.scene)
            pixels = example.pixels()
            got = {k: decode(ref, greedy(model, ref, q.prompt, pixels)) for k, q in asked.items()}
            exact = all(got[k] == q.answer for k, q in asked.items() if k != "where")
            if exact and box_iou(got["where"], asked["where"].answer) >= 0.5:
                print(example.scene.shapes, got, "box IoU", round(box_iou(got["where"], asked["where"].answer), 2))
                found += 1
                if found == 3:
                    return


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="only record the reference answers")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps (default: %(default)s)")
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
    parser.add_argument("--find-demo", type=pathlib.Path, help="print demo scenes these weights answer right")
    args = parser.parse_args(argv)
    if args.find_demo:
        return find_demo(args.find_demo)
    if not args.record:
        train(args.steps, args.out, args.init, args.lr, args.kind_weights)
    if args.out is None:
        record_reference()


if __name__ == "__main__":
    main()
