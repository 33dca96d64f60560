"""Build the committed tiny tokenizer in compass_compat/data/tiny_tokenizer/.

A byte-level BPE of 512 entries, shaped like Cohere's tokenizer where it matters to a loader:
ByteLevel pre-tokenizer and decoder, <PAD>/<UNK>/<BOS_TOKEN>/<EOS_TOKEN> at the start of the
vocabulary, the turn and vision tokens as special added tokens at its end, and a post-processor
that prepends <BOS_TOKEN>. The files are written by hand (not by a transformers
``save_pretrained``) so that transformers 4.57 and 5.x both load them with ``AutoTokenizer``.

Run once, then commit the output:  python scripts/make_tiny_tokenizer.py
Needs only the ``tokenizers`` package.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = pathlib.Path(__file__).resolve().parent.parent / "compass_compat" / "data" / "tiny_tokenizer"

VOCAB_SIZE = 512
# Ids 0..3, learned vocabulary after them, as in Cohere's tokenizer.
LEADING_SPECIALS = ["<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>"]
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

CHAT_TEMPLATE = (
    "{#- Cohere-style chat template of the compass-compat tiny test checkpoint. -#}\n"
    "{%- macro render_content(content) -%}\n"
    "{%- if content is string -%}{{- content -}}\n"
    "{%- elif content is not none -%}\n"
    "{%- for part in content -%}\n"
    "{%- if part is string -%}{{- part -}}\n"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] if part['text'] is defined else part['content'] -}}\n"
    "{%- elif part['type'] in ['image', 'image_url'] or (part['type'] is not defined and "
    "(part['image'] is defined or part['image_url'] is defined or part['url'] is defined)) -%}"
    "{{- '<|VISION_START|><|IMAGE_PAD|><|VISION_END|>' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + render_content(message['content']) + '<|END_OF_TURN_TOKEN|>' -}}\n"
    "{%- elif message['role'] == 'system' -%}"
    "{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + render_content(message['content']) + '<|END_OF_TURN_TOKEN|>' -}}\n"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}"
    "{%- generation -%}"
    "{{- render_content(message['content']) + '<|END_OF_TURN_TOKEN|>' -}}"
    "{%- endgeneration -%}\n"
    "{%- else -%}{{- raise_exception('Unknown role: ' + message['role']) -}}\n"
    "{%- endif -%}\n"
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


def special_tokens_map() -> dict:
    return {
        "bos_token": "<BOS_TOKEN>",
        "eos_token": "<|END_OF_TURN_TOKEN|>",
        "unk_token": "<UNK>",
        "pad_token": "<PAD>",
        "additional_special_tokens": ["<EOS_TOKEN>", *TRAILING_SPECIALS],
    }


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
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        **special_tokens_map(),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    tok = build()
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"), pretty=True)
    dump = lambda obj: json.dumps(obj, indent=2, ensure_ascii=False) + "\n"  # noqa: E731
    (OUT / "tokenizer_config.json").write_text(dump(tokenizer_config(tok)), encoding="utf-8")
    (OUT / "special_tokens_map.json").write_text(dump(special_tokens_map()), encoding="utf-8")
    (OUT / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    ids = {t: tok.token_to_id(t) for t in LEADING_SPECIALS + TRAILING_SPECIALS}
    print(f"wrote {OUT} ({tok.get_vocab_size(with_added_tokens=True)} tokens)")
    print(json.dumps(ids))


if __name__ == "__main__":
    main()
