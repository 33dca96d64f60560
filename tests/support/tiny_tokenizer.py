"""A tiny Cohere-shaped tokenizer for processor tests, built with the `tokenizers` library.

Word-level vocabulary; the Cohere special tokens; a post-processor that prepends
<BOS_TOKEN> as Cohere's does. Saved with the running transformers' PreTrainedTokenizerFast,
so each environment reads back what it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

from compass_data.tiny import special_token_ids

# Cohere's turn and vision tokens, in the committed tiny tokenizer's order; ids from 0 in this order.
TURN_AND_VISION = [t for t, _ in sorted(special_token_ids().items(), key=lambda item: item[1]) if t.startswith("<|")]
SPECIAL_TOKENS = ["<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>", *TURN_AND_VISION]
WORDS = "describe this image what is in the a cat dog and compare two images picture . ? , hello".split()

# Shaped like the checkpoint's template: BOS, Cohere turns, one pad per image part.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' -}}"
    "{%- elif message['role'] == 'system' -%}{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' -}}"
    "{%- else -%}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|VISION_START|><|IMAGE_PAD|><|VISION_END|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|END_OF_TURN_TOKEN|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}{%- endif -%}"
)


def build_tiny_tokenizer(out_dir: Path, *, chat_template_in_config: bool = False) -> Path:
    """Write tokenizer files to ``out_dir`` and return it. The chat template goes to
    chat_template.jinja unless ``chat_template_in_config`` puts it in tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<UNK>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single="<BOS_TOKEN> $A",
        pair="<BOS_TOKEN> $A $B:1",
        special_tokens=[("<BOS_TOKEN>", vocab["<BOS_TOKEN>"])],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<BOS_TOKEN>",
        eos_token="<|END_OF_TURN_TOKEN|>",
        unk_token="<UNK>",
        pad_token="<PAD>",
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # Exactly one template source, written by hand: transformers versions differ in where
    # save_pretrained puts it.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    jinja = out_dir / "chat_template.jinja"
    jinja.unlink(missing_ok=True)
    if chat_template_in_config:
        config["chat_template"] = CHAT_TEMPLATE
    else:
        jinja.write_text(CHAT_TEMPLATE, encoding="utf-8")
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out_dir
