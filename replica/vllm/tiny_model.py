"""A tiny random Llama that vLLM (CPU build) can load: for tests and laptops, no model hub.

``build_tiny_model(out_dir)`` writes a complete Hugging Face model directory:

* the tokenizer files and chat template from ``replica.vllm.tiny_tokenizer.build_tokenizer``
  (a locally trained BPE; Llama-3-style or ChatML-style template);
* ``config.json``: ``LlamaForCausalLM`` with 2 layers, hidden size 128, 4 attention heads
  of 32 (2 KV heads, grouped-query attention), ``vocab_size`` equal to the tokenizer's,
  ``max_position_embeddings`` 4096, ``torch_dtype`` float32 (numpy cannot write bfloat16;
  ``replica.vllm.launcher`` starts the CPU build with ``--dtype float32``);
* ``generation_config.json``;
* ``model.safetensors``: random weights written with numpy only.

Contracts:

* Deterministic: the same arguments give byte-identical files (the weights come from a
  seeded ``numpy.random.Generator``; JSON is written with sorted keys).
* No torch: the router's venv has none.  The safetensors container is written by hand:
  an 8-byte little-endian header length, a JSON header mapping each tensor name to
  ``{"dtype", "shape", "data_offsets"}`` (plus ``__metadata__``), padded with spaces to a
  multiple of 8 bytes, then the raw little-endian tensor bytes in header order.
* The model is random: its output is noise.  It exists so that the real engine's
  scheduler, block pool, prefix cache and KV events can be exercised on 2 CPU cores.

What it does not do: quantisation, tied embeddings, anything beyond what vLLM's Llama
loader needs.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

Template = Literal["llama3", "chatml"]


@dataclass(frozen=True, slots=True)
class TinyLlamaShape:
    """The architecture of the tiny model (all sizes vLLM's CPU attention accepts)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        """Size of one attention head (CPU attention supports 32, 64, 80, ...)."""
        return self.hidden_size // self.num_attention_heads


def write_safetensors(
    path: Path,
    tensors: Mapping[str, npt.NDArray[np.float32]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` (float32 arrays) as a safetensors file, in the given order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    blobs: list[bytes] = []
    for name, arr in tensors.items():
        if arr.dtype != np.float32:
            raise TypeError(f"{name}: only float32 tensors are supported, got {arr.dtype}")
        blob = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header, separators=(",", ":"), sort_keys=False).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def read_safetensors_header(path: Path) -> dict[str, object]:
    """The JSON header of a safetensors file (for checks and tests)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        parsed: dict[str, object] = json.loads(f.read(n))
    return parsed


def _llama_weights(
    shape: TinyLlamaShape, vocab_size: int, seed: int
) -> Iterator[tuple[str, npt.NDArray[np.float32]]]:
    rng = np.random.default_rng(seed)
    h, inter, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q_out = shape.num_attention_heads * hd
    kv_out = shape.num_key_value_heads * hd

    def normal(*dims: int) -> npt.NDArray[np.float32]:
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(0.02)).astype(
            np.float32
        )

    def ones(n: int) -> npt.NDArray[np.float32]:
        return np.ones(n, dtype=np.float32)

    yield "model.embed_tokens.weight", normal(vocab_size, h)
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", ones(h)
        yield p + "self_attn.q_proj.weight", normal(q_out, h)
        yield p + "self_attn.k_proj.weight", normal(kv_out, h)
        yield p + "self_attn.v_proj.weight", normal(kv_out, h)
        yield p + "self_attn.o_proj.weight", normal(h, q_out)
        yield p + "post_attention_layernorm.weight", ones(h)
        yield p + "mlp.gate_proj.weight", normal(inter, h)
        yield p + "mlp.up_proj.weight", normal(inter, h)
        yield p + "mlp.down_proj.weight", normal(h, inter)
    yield "model.norm.weight", ones(h)
    yield "lm_head.weight", normal(vocab_size, h)


def llama_config(
    shape: TinyLlamaShape, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None
) -> dict[str, object]:
    """The ``config.json`` contents for the tiny Llama."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _special_id(tokenizer_json: dict[str, object], content: str | None) -> int | None:
    if not content:
        return None
    added = tokenizer_json.get("added_tokens")
    if isinstance(added, list):
        for tok in added:
            if isinstance(tok, dict) and tok.get("content") == content:
                tid = tok.get("id")
                return tid if isinstance(tid, int) else None
    model = tokenizer_json.get("model")
    if isinstance(model, dict):
        vocab = model.get("vocab")
        if isinstance(vocab, dict):
            tid = vocab.get(content)
            return tid if isinstance(tid, int) else None
    return None


def _token_content(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _vocab_size(tokenizer_json: dict[str, object]) -> int:
    ids: list[int] = []
    model = tokenizer_json.get("model")
    if isinstance(model, dict) and isinstance(model.get("vocab"), dict):
        ids.extend(v for v in model["vocab"].values() if isinstance(v, int))
    added = tokenizer_json.get("added_tokens")
    if isinstance(added, list):
        ids.extend(t["id"] for t in added if isinstance(t, dict) and isinstance(t.get("id"), int))
    if not ids:
        raise ValueError("tokenizer.json has no vocabulary")
    return max(ids) + 1


def write_model_files(
    out_dir: Path,
    *,
    shape: TinyLlamaShape = TinyLlamaShape(),
    seed: int = 0,
) -> Path:
    """Write config, generation config and weights next to an existing tokenizer.

    ``out_dir`` must already hold ``tokenizer.json`` and ``tokenizer_config.json``; the
    vocabulary size and the BOS/EOS ids are read from them.  The embedding has exactly
    one row per token id (no padding), so the random model can only sample ids the
    tokenizer can decode.
    """
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    vocab = _vocab_size(tok)
    bos = _special_id(tok, _token_content(tok_cfg.get("bos_token")))
    eos = _special_id(tok, _token_content(tok_cfg.get("eos_token")))
    config = llama_config(shape, vocab, bos, eos)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    (out_dir / "generation_config.json").write_text(
        json.dumps(gen, indent=2, sort_keys=True) + "\n"
    )
    write_safetensors(
        out_dir / "model.safetensors",
        dict(_llama_weights(shape, vocab, seed)),
        metadata={"format": "pt"},
    )
    return out_dir


def build_tiny_model(
    out_dir: Path | str,
    *,
    template: Template = "llama3",
    vocab_size: int = 2000,
    seed: int = 0,
    shape: TinyLlamaShape = TinyLlamaShape(),
) -> Path:
    """Build the whole tiny model directory (tokenizer + config + weights); returns it."""
    from replica.vllm.tiny_tokenizer import build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, template=template, vocab_size=vocab_size)
    return write_model_files(out, shape=shape, seed=seed)


__all__ = [
    "TinyLlamaShape",
    "Template",
    "build_tiny_model",
    "llama_config",
    "read_safetensors_header",
    "write_model_files",
    "write_safetensors",
]
