"""Which output head transformers runs for each tie_word_embeddings setting (shared by the config
and the tied-head tests)."""

# (top, text, lm_head stored) -> the head transformers 5.24 runs (measured on the tiny
# checkpoint, tests/test_tie_head.py re-measures it live): "embedding", "stored", or "random"
# (no lm_head stored and not tied: newly initialised). Its text_config key is never read.
REFERENCE_HEAD = {
    (top, text, stored): ("stored" if stored else "embedding" if top else "random")
    for top in (None, True, False)
    for text in (None, True, False)
    for stored in (False, True)
}
