"""A tiny, locally trained tokenizer with a real chat template: no model hub, ever.

``build_tokenizer(out_dir, template="llama3" | "chatml")`` trains a small byte-level BPE
with the ``tokenizers`` package on a deterministic synthetic corpus and writes a
Hugging Face tokenizer directory that ``transformers.AutoTokenizer.from_pretrained`` and
vLLM 0.32 load offline:

* ``tokenizer.json``: the BPE model, a regex split + byte-level pre-tokenizer (the
  Llama-3 pattern for ``llama3``, the Qwen2-style pattern with single digits and an NFC
  normalizer for ``chatml``), the style's special tokens added *after* training (so they
  take the highest ids, as in the real models), and the post-processor: for ``llama3``
  ``<|begin_of_text|>`` is prepended when ``add_special_tokens=True``; ``chatml`` adds
  nothing.
* ``tokenizer_config.json``: ``tokenizer_class: PreTrainedTokenizerFast``,
  ``chat_template``, ``bos_token`` (``None`` for chatml), ``eos_token`` (``<|eot_id|>`` /
  ``<|im_end|>``), ``pad_token``, ``model_max_length``,
  ``clean_up_tokenization_spaces: false``.
* ``special_tokens_map.json``.

Special tokens: llama3 ``<|begin_of_text|>``, ``<|start_header_id|>``,
``<|end_header_id|>``, ``<|eot_id|>``, ``<|end_of_text|>``; chatml ``<|im_start|>``,
``<|im_end|>``, ``<|endoftext|>``.  ``extra_special_tokens`` adds more (tests use it to vary
the special-token set).

The chat templates are kvroute's own, in the two styles.  Both accept ``system``,
``user``, ``assistant`` and ``tool`` roles, string or list-of-parts content (text parts
are concatenated), assistant ``tool_calls``, ``tools``, ``documents``,
``add_generation_prompt`` and an ``enable_thinking`` chat-template kwarg (``false`` adds
an empty think block after the generation prompt, in the style of reasoning models).
They raise (``raise_exception``) on an unknown role.

Contracts: deterministic (same arguments, byte-identical files) and fast (well under
2 s for the default 2,000-token vocabulary).  ``len(tokenizer)`` equals ``vocab_size``
when the corpus is rich enough (the default corpus is); with a small custom corpus the
BPE may stop early, and the vocabulary is then smaller.

Command line: ``python -m replica.vllm.tiny_tokenizer OUT_DIR --template llama3`` prints the
directory it wrote.

What it does not do: download anything, or produce a tokenizer that is good at anything
but being small, real and deterministic.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

TemplateStyle = Literal["llama3", "chatml"]

LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|end_of_text|>",
)
CHATML_SPECIAL_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

# The split patterns of the two families (letters, 1-3 or 1 digits, punctuation runs,
# newline runs, whitespace) so that the tiny tokenizers pre-tokenise like the real ones.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CHATML_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_TEMPLATE = (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}\n"
    "{{- bos_token -}}\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}\n"
    "{%- set system_text = text_of(messages[0]['content']) -%}\n"
    "{%- set rest = messages[1:] -%}\n"
    "{%- else -%}\n"
    "{%- set system_text = '' -%}\n"
    "{%- set rest = messages -%}\n"
    "{%- endif -%}\n"
    "{%- if system_text or tools or documents -%}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' ~ system_text -}}\n"
    "{%- if tools -%}\n"
    "{{- '\\n\\nYou may call these functions. To call one, reply with a JSON object "
    '{"name": function name, "parameters": arguments}.\\n\\n\' -}}\n'
    "{%- for tool in tools -%}{{- tool | tojson(indent=4) -}}{{- '\\n\\n' -}}{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{%- if documents -%}\n"
    "{{- '\\nDocuments:\\n' if tools else '\\n\\nDocuments:\\n' -}}\n"
    "{%- for doc in documents -%}\n"
    "{{- '[' ~ loop.index ~ '] ' -}}"
    "{%- if doc['title'] is defined -%}{{- doc['title'] ~ ': ' -}}{%- endif -%}"
    "{{- doc['text'] if doc['text'] is defined else doc | tojson -}}{{- '\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|eot_id|>' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in rest -%}\n"
    "{%- if message['role'] not in ['user', 'assistant', 'tool', 'system'] -%}\n"
    "{{- raise_exception('Unknown role: ' ~ message['role']) -}}\n"
    "{%- endif -%}\n"
    "{%- set header = 'ipython' if message['role'] == 'tool' else message['role'] -%}\n"
    "{{- '<|start_header_id|>' ~ header ~ '<|end_header_id|>\\n\\n' -}}\n"
    "{%- set content = message['content'] -%}\n"
    "{%- if content is string -%}{{- content -}}\n"
    "{%- elif content is iterable and content is not mapping -%}\n"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}\n"
    "{%- for call in message['tool_calls'] -%}\n"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}\n"
    "{{- '{\"name\": \"' ~ fn['name'] ~ '\", \"parameters\": ' -}}"
    "{{- fn['arguments'] | tojson -}}{{- '}' -}}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|eot_id|>' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}\n"
    "{%- endif -%}\n"
)

CHATML_TEMPLATE = (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}\n"
    "{%- if tools or documents -%}\n"
    "{{- '<|im_start|>system\\n' -}}\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- text_of(messages[0]['content']) ~ '\\n\\n' -}}{%- endif -%}\n"
    "{%- if tools -%}\n"
    "{{- '# Tools\\n\\nYou may call one or more functions. Signatures:\\n<tools>' -}}\n"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}\n"
    "{{- '\\n</tools>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- if documents -%}\n"
    "{{- '# Documents\\n' -}}\n"
    "{%- for doc in documents -%}"
    "{{- '<document index=\"' ~ loop.index ~ '\">' ~ (doc['text'] if doc['text'] is defined "
    "else doc | tojson) ~ '</document>\\n' -}}{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- elif messages and messages[0]['role'] == 'system' -%}\n"
    "{{- '<|im_start|>system\\n' ~ text_of(messages[0]['content']) ~ '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'system' and loop.first -%}{%- continue -%}{%- endif -%}\n"
    "{%- if message['role'] not in ['user', 'assistant', 'tool', 'system'] -%}\n"
    "{{- raise_exception('Unknown role: ' ~ message['role']) -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' -}}\n"
    "{%- set content = message['content'] -%}\n"
    "{%- if content is string -%}{{- content -}}\n"
    "{%- elif content is iterable and content is not mapping -%}\n"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}\n"
    "{%- for call in message['tool_calls'] -%}\n"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}\n"
    "{{- '\\n<tool_call>\\n{\"name\": \"' ~ fn['name'] ~ '\", \"arguments\": ' -}}"
    "{{- fn['arguments'] | tojson -}}{{- '}\\n</tool_call>' -}}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}\n"
    "{%- endif -%}\n"
)

_SYLLABLES = (
    "ka ro mi te su na lo vi pe da ge ri bo zu an en in on un ar er or th st "
    "ch sh qu pr tr gr bl cl fl ing ion ent est ous ive ly ment able"
).split()
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from "
    "at which but have an they you were her she there been one all we their has would "
    "when if so no what up out who them some can more could into time only other new "
    "user assistant system tool function name arguments parameters document title text "
    "cache block token prefix router replica request model hello world please thanks"
).split()


def default_corpus(seed: int = 0, n_lines: int = 4000) -> Iterator[str]:
    """A deterministic synthetic corpus: words, pseudo-words, numbers, punctuation, JSON.

    Rich enough that a 2,000-token BPE fills its vocabulary, small enough to train in a
    fraction of a second.
    """
    rng = random.Random(seed)
    punct = [".", ",", "!", "?", ":", ";", " -", "(", ")", '"', "'s", "\n", "\n\n"]
    for i in range(n_lines):
        parts: list[str] = []
        for _ in range(rng.randint(4, 24)):
            r = rng.random()
            if r < 0.55:
                w = rng.choice(_WORDS)
            elif r < 0.85:
                w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            elif r < 0.93:
                w = str(rng.randint(0, 99999))
            else:
                w = rng.choice(punct)
            if rng.random() < 0.1:
                w = w.capitalize()
            parts.append(w)
        line = " ".join(parts)
        if i % 7 == 0:
            line = json.dumps({"name": rng.choice(_WORDS), "arguments": {"x": line[:20]}})
        yield line


def _special_tokens(template: TemplateStyle, extra: Sequence[str]) -> tuple[str, ...]:
    base = LLAMA3_SPECIAL_TOKENS if template == "llama3" else CHATML_SPECIAL_TOKENS
    return base + tuple(t for t in extra if t not in base)


def build_tokenizer(
    out_dir: Path | str,
    *,
    template: TemplateStyle,
    vocab_size: int = 2000,
    corpus: Iterable[str] | None = None,
    extra_special_tokens: Sequence[str] = (),
    add_prefix_space: bool = False,
    model_max_length: int = 131072,
) -> Path:
    """Train and write a tiny tokenizer directory in ``template``'s style; returns it.

    ``vocab_size`` counts everything (256 byte symbols, merges, special tokens).
    ``corpus`` replaces the built-in deterministic corpus.  ``extra_special_tokens`` are
    added after the style's own; ``add_prefix_space`` sets the byte-level
    pre-tokenizer's flag (tests use both to vary tokenizers).  ``out_dir`` is created if
    needed; existing tokenizer files in it are overwritten.
    """
    if template not in ("llama3", "chatml"):
        raise ValueError(f"template must be 'llama3' or 'chatml', got {template!r}")
    specials = _special_tokens(template, extra_special_tokens)
    if vocab_size < 256 + len(specials) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    split = _LLAMA3_SPLIT if template == "llama3" else _CHATML_SPLIT
    if template == "chatml":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(
                add_prefix_space=add_prefix_space, trim_offsets=False, use_regex=False
            ),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus if corpus is not None else default_corpus(), trainer=trainer)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False)
            for t in specials
        ]
    )
    if template == "llama3":
        bos = "<|begin_of_text|>"
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))

    if template == "llama3":
        bos_token: str | None = "<|begin_of_text|>"
        eos_token, pad_token = "<|eot_id|>", "<|end_of_text|>"
        chat_template = LLAMA3_TEMPLATE
    else:
        bos_token = None
        eos_token, pad_token = "<|im_end|>", "<|endoftext|>"
        chat_template = CHATML_TEMPLATE
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    specials_map: dict[str, object] = {"eos_token": eos_token, "pad_token": pad_token}
    if bos_token is not None:
        specials_map["bos_token"] = bos_token
    extra = [t for t in specials if t not in (bos_token, eos_token, pad_token)]
    if extra:
        specials_map["additional_special_tokens"] = extra
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", specials_map)
    return out


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m replica.vllm.tiny_tokenizer OUT_DIR [--template llama3|chatml]``."""
    import argparse

    parser = argparse.ArgumentParser(description="Train and write a tiny tokenizer.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--template", choices=["llama3", "chatml"], default="llama3")
    parser.add_argument("--vocab-size", type=int, default=2000)
    args = parser.parse_args(argv)
    style: TemplateStyle = "chatml" if args.template == "chatml" else "llama3"
    print(build_tokenizer(args.out_dir, template=style, vocab_size=args.vocab_size))


__all__ = [
    "CHATML_SPECIAL_TOKENS",
    "CHATML_TEMPLATE",
    "LLAMA3_SPECIAL_TOKENS",
    "LLAMA3_TEMPLATE",
    "TemplateStyle",
    "build_tokenizer",
    "default_corpus",
    "main",
]


if __name__ == "__main__":
    main()
