"""mlx-vlm's server admission, in process: the pin's own ``BatchGenerator`` (0.6.12+) driven as
``mlx_vlm.server`` drives it, for any model of the pin, with
or without the pin's automatic prefix cache (APC).

Each request goes in as the server inserts it: ``get_input_embeddings`` on its ids and pixels,
the output's non-None fields plus the processor's arrays as its prompt kwargs, and
``_apc_image_hash`` naming its picture (the server hashes the image reference). :func:`serve`
inserts the first request, steps the generator until that request has its first token (it is
decoding), then inserts the others together (one prefill batch) and steps until every request
is done: the order in which the server admits a request already running and requests that
arrive together. Greedy sampling, as the server's at temperature 0.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

Request = Dict[str, Any]  # input_ids [1, L], optional pixel_values / image_grid_thw / mask, image_hash


class _Stops:
    """The ``processor.tokenizer.stopping_criteria`` BatchGenerator asks for: the request stops
    at the given EOS ids, with no processor."""

    def __init__(self, eos: Sequence[int]):
        from mlx_vlm.utils import StoppingCriteria

        self.stopping_criteria = StoppingCriteria(list(eos), None)


def prompt_kwargs(model, request: Request) -> Dict[str, Any]:
    """What the server inserts for ``request`` (its ``_gpu_embed``)."""
    extra = {k: v for k, v in request.items() if k not in ("input_ids", "pixel_values", "mask", "image_hash")}
    emb = model.get_input_embeddings(
        request["input_ids"], request.get("pixel_values"), mask=request.get("mask"), **extra
    )
    fields = emb.to_dict() if hasattr(emb, "to_dict") else vars(emb)
    kwargs = {**extra, **{k: v for k, v in fields.items() if v is not None}}
    if request.get("image_hash") is not None:
        kwargs["_apc_image_hash"] = request["image_hash"]
    return kwargs


def serve(
    model,
    eos: Sequence[int],
    first: Request,
    together: Sequence[Request],
    max_tokens: int,
    apc: bool,
    prefill_step_size: Optional[int] = None,
) -> List[List[int]]:
    """Greedy ids of ``first`` and of each of ``together`` (in that order), served as above."""
    import mlx.core as mx
    from mlx_vlm import apc as _apc
    from mlx_vlm.generate.ar import DEFAULT_PREFILL_STEP_SIZE, BatchGenerator

    manager = _apc.APCManager(num_blocks=256, block_size=16) if apc else None
    generator = BatchGenerator(
        model.language_model,
        _Stops(eos),
        max_tokens=max_tokens,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
        apc_manager=manager,
        prefill_step_size=prefill_step_size or DEFAULT_PREFILL_STEP_SIZE,
        greedy_sampling=True,
    )
    tokens: Dict[int, List[int]] = {}
    done: set = set()

    def insert(requests: Sequence[Request]) -> List[int]:
        uids = generator.insert(
            [r["input_ids"].reshape(-1).tolist() for r in requests],
            max_tokens=max_tokens,
            prompt_kwargs=[prompt_kwargs(model, r) for r in requests],
        )
        for uid in uids:
            tokens[uid] = []
        return list(uids)

    def step() -> None:
        out = generator.next()
        responses = out[1] if isinstance(out, tuple) else out
        for r in responses:
            tokens[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                done.add(r.uid)

    uids = insert([first])
    while not tokens[uids[0]] and uids[0] not in done:
        step()
    uids += insert(list(together))
    while not done.issuperset(uids):
        step()
    generator.close()
    return [tokens[uid] for uid in uids]


class _Echo:
    """A model-free stand-in for the probe below: its logits at a column name the token fed
    there, so a sampled first token says which prompt column the pin took the logits from."""

    def __init__(self, vocab: int = 64):
        import mlx.core as mx
        from mlx_vlm.models.cache import RotatingKVCache

        self.vocab, self._mx, self._cache = vocab, mx, RotatingKVCache
        self.language_model = self
        self.layers = [None]

    def make_cache(self):
        return [self._cache(max_size=8, keep=0)]  # a sliding window: the exact-prefix APC mode

    def get_input_embeddings(self, input_ids, pixel_values=None, mask=None, **kwargs):
        from types import SimpleNamespace

        embeds = input_ids.astype(self._mx.float32)[..., None]
        return SimpleNamespace(to_dict=lambda: {"inputs_embeds": embeds})

    def __call__(self, inputs=None, inputs_embeds=None, cache=None, **kwargs):
        mx = self._mx
        ids = inputs if inputs_embeds is None else inputs_embeds[..., 0].astype(mx.int32)
        B, L = ids.shape
        kv = mx.zeros((B, 1, L, 4))
        cache[0].update_and_fetch(kv, kv)
        return mx.eye(self.vocab)[ids] * 10.0


def pin_samples_a_padding_column() -> bool:
    """Whether the pin's server admission samples a request's first token from a padding column:
    mlx-vlm 0.6.12's mixed warm/cold prefill (prefix cache on) right-pads the rows and, after a
    prefill cut into chunks, reads each row's last real column in the final chunk only, so a
    restored row whose padding outlasts that chunk gets a padding column's logits (0.7.x keeps
    those rows' logits from the chunk they ended in). Measured with :class:`_Echo`, no model of ours."""
    import mlx.core as mx

    echo = _Echo()
    first = {"input_ids": mx.array([list(range(1, 41))]), "image_hash": 1}
    other = {"input_ids": mx.array([[(7 * i) % 60 + 1 for i in range(80)]]), "image_hash": 2}
    tokens = serve(echo, [], first, [other, first], 1, apc=True, prefill_step_size=32)
    return tokens[2][0] != 40  # the repeated request's first token is its last prompt token
