"""Text that stresses the tiny tokenizers of ``tests/prompt/conftest.py``: every
variant's special tokens, pieces of them, and unicode and whitespace around them.

``texts(...)`` draws strings from those fragments, for the properties that hold split
and incremental encodings equal to whole-text encodings."""

from __future__ import annotations

from hypothesis import strategies as st

VARIANTS = ["llama3", "chatml", "chatml_prefix", "llama3_extra"]
"""The tokenizer variants (``tests/prompt/conftest.py``'s ``TOKENIZER_VARIANTS``)."""

SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|start_header_id|>sys",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "<|python_tag|>",
    "<|",
    "|>",
]
"""Every variant's added tokens, one that overlaps another, and halves of them."""

ALPHABET = "ab cdeXYZ 019 .,!?'\"\n\t  éè\u0301日本🙂-_{}[]:"


def texts(*, max_fragment: int, max_fragments: int) -> st.SearchStrategy[str]:
    """Strings of up to ``max_fragments`` fragments: plain text of up to
    ``max_fragment`` characters, special tokens, or words the templates use."""
    fragments = st.one_of(
        st.text(alphabet=ALPHABET, max_size=max_fragment),
        st.sampled_from(SPECIALS),
        st.sampled_from(["system", "user", "tem", " ", "\n\n", "  \n", "'s", "123456"]),
    )
    return st.lists(fragments, max_size=max_fragments).map("".join)
