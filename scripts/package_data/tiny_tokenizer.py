"""Build the committed tiny tokenizer in compass_data/tiny_tokenizer/.

A byte-level BPE of 512 entries, shaped like Cohere's tokenizer where it matters to a loader:
ByteLevel pre-tokenizer and decoder, Cohere's ids 0-7 (<PAD> <UNK> <CLS> <SEP> <MASK_TOKEN>
<BOS_TOKEN> <EOS_TOKEN> <EOP_TOKEN>), the turn and vision tokens as special added tokens at its
end, and a post-processor that prepends <BOS_TOKEN>. The file set and the tokenizer_config.json
keys are the published checkpoint's (``tokenizer_class: CohereTokenizer``, ``backend:
tokenizers``, no ``add_bos_token``, ``padding_side: right``, ``min_pixels``/``max_pixels``), and
chat_template.jinja renders as the published template does. Written by hand (not by a
transformers ``save_pretrained``) so that every pin's transformers loads them alike.

Run once, then commit the output:  python scripts/package_data/tiny_tokenizer.py
Needs only the ``tokenizers`` package.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = pathlib.Path(__file__).resolve().parents[2] / "compass_data" / "tiny_tokenizer"

VOCAB_SIZE = 512
# Ids 0..7 as in Cohere's tokenizer, the learned vocabulary after them.
LEADING_SPECIALS = ["<PAD>", "<UNK>", "<CLS>", "<SEP>", "<MASK_TOKEN>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<EOP_TOKEN>"]
# Appended after the learned vocabulary (Cohere keeps these at the top of its id range).
TRAILING_SPECIALS = [
    "<|START_OF_TURN_TOKEN|>",
    "<|END_OF_TURN_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<|SYSTEM_TOKEN|>",
    "<|VISION_START|>",
    "<|VISION_END|>",
    "<|IMAGE_PAD|>",
    "<|VIDEO_PAD|>",
]

# Behaves as the published chat_template.jinja does (written here, not copied): BOS, then each
# system/user/assistant/chatbot turn; other roles are dropped; in list content, user image and
# video parts render a vision block, every other part only its "text" key; no generation block.
CHAT_TEMPLATE = (
    "{#- Chat template of the compass-compat tiny test checkpoint; renders as the published one. -#}\n"
    "{%- set headers = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', "
    "'assistant': '<|CHATBOT_TOKEN|>', 'chatbot': '<|CHATBOT_TOKEN|>'} -%}\n"
    "{{- bos_token -}}\n"
    "{%- for message in messages if message['role'] in headers -%}\n"
    "{{- '<|START_OF_TURN_TOKEN|>' + headers[message['role']] -}}\n"
    "{%- if message['content'] is string -%}{{- message['content'] -}}\n"
    "{%- else -%}\n"
    "{%- for part in message['content'] if part is mapping -%}\n"
    "{%- if message['role'] == 'user' and (part['type'] == 'image' or 'image' in part or 'image_url' in part) -%}"
    "{{- '<|VISION_START|><|IMAGE_PAD|><|VISION_END|>' -}}\n"
    "{%- elif message['role'] == 'user' and (part['type'] == 'video' or 'video' in part) -%}"
    "{{- '<|VISION_START|><|VIDEO_PAD|><|VISION_END|>' -}}\n"
    "{%- elif 'text' in part -%}{{- part['text'] -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|END_OF_TURN_TOKEN|>' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}{%- endif -%}\n"
)

# A small fixed English corpus; the prompts of the test suite use these words.
CORPUS = """\
Describe this image in one sentence. What is in the picture? What colour is the square?
Count the circles in the image and tell me where they are. Compare the two images.
The picture shows a red square, a blue circle and a green triangle on a smooth gradient.
There is a small yellow line near the top left corner, and the background fades from dark to light.
Please answer briefly. Write a short story about a lighthouse keeper who finds a map.
The keeper walked along the shore every morning, counting the boats that came home with the tide.
One day he found an old map inside a bottle, with a path drawn from the harbour to the hills.
He followed the path through the forest, over the river and past the farm with the white fence.
At the end of the path there was a stone house, and inside the house there was a garden full of light.
Hello! How are you today? I am fine, thank you. Can you help me with my homework?
Of course. Tell me the question and I will explain each step of the answer.
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 448 640.
The model reads the text, looks at the image, and writes an answer one token at a time.
A language model predicts the next word from the words before it; a vision model turns pixels into features.
Summarise the following paragraph: the city was quiet in the early morning, the streets were wet with rain,
and the first buses carried workers to the station while the shops were still closed.
List three things you can see: a table, a chair and a window with the sun shining through it.
Explain why the sky is blue. Sunlight is scattered by the air, and blue light is scattered more than red light.
What time is it? It is half past nine in the morning. The meeting starts at ten o'clock.
Translate to French: good morning, good night, thank you very much, see you tomorrow.
The children played in the park until the evening, when their parents called them home for dinner.
Mathematics: two plus two is four, three times five is fifteen, and the square root of sixty four is eight.
Shapes and colours: red, orange, yellow, green, blue, purple, black, white, grey; square, circle, triangle, line.
The image is four hundred and forty eight pixels wide and four hundred and forty eight pixels high.
"""


def ascii_alphabet() -> list:
    """ByteLevel symbols of printable ASCII, tab and newline only.

    With no symbol for bytes >= 0x80, every token decodes to complete UTF-8, so the
    random model's greedy output can be streamed by any mlx-vlm detokenizer
    (0.4.x's BPE streaming detokenizer raises on a lone continuation byte).
    """
    symbols = pre_tokenizers.ByteLevel.alphabet()
    ascii_bytes = [9, 10] + list(range(32, 127))
    mapped = Tokenizer(models.BPE())
    mapped.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    out = []
    for b in ascii_bytes:
        piece = mapped.pre_tokenizer.pre_tokenize_str(chr(b))[0][0]
        assert piece in symbols
        out.append(piece)
    return out


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<UNK>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TRAILING_SPECIALS),
        min_frequency=1,
        show_progress=False,
        special_tokens=LEADING_SPECIALS,
        initial_alphabet=ascii_alphabet(),
        limit_alphabet=len(ascii_alphabet()),
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens(TRAILING_SPECIALS)
    bos = tok.token_to_id("<BOS_TOKEN>")
    tok.post_processor = processors.TemplateProcessing(
        single="<BOS_TOKEN> $A",
        pair="<BOS_TOKEN> $A $B:1",
        special_tokens=[("<BOS_TOKEN>", bos)],
    )
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise SystemExit(f"vocabulary has {tok.get_vocab_size(with_added_tokens=True)} entries, want {VOCAB_SIZE}")
    return tok


# The published tokenizer_config.json's keys. Its pixel bounds (16384 / 3868706) are scaled to
# tiny images; transformers' processor merges them into the image kwargs, so they must be here.
MIN_PIXELS, MAX_PIXELS = 16384, 602112


def tokenizer_config(tok: Tokenizer) -> dict:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in LEADING_SPECIALS + TRAILING_SPECIALS
    }
    # No add_bos_token key, as published: the class default (True) applies.
    return {
        "added_tokens_decoder": added,
        "backend": "tokenizers",
        "bos_token": "<BOS_TOKEN>",
        "clean_up_tokenization_spaces": False,
        "cls_token": "<CLS>",
        "eos_token": "<|END_OF_TURN_TOKEN|>",
        "mask_token": "<MASK_TOKEN>",
        "max_pixels": MAX_PIXELS,
        "min_pixels": MIN_PIXELS,
        "model_max_length": 8192,
        "model_specific_special_tokens": {
            "image_token": "<|IMAGE_PAD|>",
            "video_token": "<|VIDEO_PAD|>",
            "vision_start_token": "<|VISION_START|>",
            "vision_end_token": "<|VISION_END|>",
        },
        "pad_token": "<PAD>",
        "padding_side": "right",
        "processor_class": "CohereCompassProcessor",
        "sep_token": "<SEP>",
        "tokenizer_class": "CohereTokenizer",
        "unk_token": "<UNK>",
    }


def main() -> None:
    tok = build()
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"), pretty=True)
    dump = lambda obj: json.dumps(obj, indent=2, ensure_ascii=False) + "\n"  # noqa: E731
    (OUT / "tokenizer_config.json").write_text(dump(tokenizer_config(tok)), encoding="utf-8")
    (OUT / "special_tokens_map.json").unlink(missing_ok=True)  # not in the published file set
    (OUT / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    ids = {t: tok.token_to_id(t) for t in LEADING_SPECIALS + TRAILING_SPECIALS}
    print(f"wrote {OUT} ({tok.get_vocab_size(with_added_tokens=True)} tokens)")
    print(json.dumps(ids))


if __name__ == "__main__":
    main()
