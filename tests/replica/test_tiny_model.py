"""The tiny random Llama: a loadable, deterministic Hugging Face directory, numpy only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoTokenizer

from kvroute.cli import main
from replica.vllm.tiny_model import (
    TinyLlamaShape,
    build_tiny_model,
    read_safetensors_header,
    write_safetensors,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), template="llama3")


def test_directory_has_everything_vllm_loads(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 128
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 32
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # One embedding row per token id: the random model can only sample decodable ids.
    assert cfg["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert cfg["bos_token_id"] == tok.token_to_id("<|begin_of_text|>")
    assert cfg["eos_token_id"] == tok.token_to_id("<|eot_id|>")
    hf = AutoConfig.from_pretrained(model_dir)
    assert hf.model_type == "llama" and hf.vocab_size == cfg["vocab_size"]
    assert AutoTokenizer.from_pretrained(model_dir).chat_template


def test_weights_have_llama_names_and_shapes(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    v, h, inter = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    tensors = load_file(model_dir / "model.safetensors")  # the reference reader agrees
    expected = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
                "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    assert {k: t.shape for k, t in tensors.items()} == expected
    assert all(t.dtype == np.float32 and np.isfinite(t).all() for t in tensors.values())
    assert 0.01 < float(tensors["lm_head.weight"].std()) < 0.03
    assert (tensors["model.norm.weight"] == 1).all()


def test_build_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", template="llama3")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    other = build_tiny_model(tmp_path / "seed1", template="llama3", seed=1)
    assert (other / "model.safetensors").read_bytes() != (
        model_dir / "model.safetensors"
    ).read_bytes()


def test_chatml_model_has_no_bos(tmp_path: Path) -> None:
    d = build_tiny_model(tmp_path, template="chatml", shape=TinyLlamaShape(num_hidden_layers=1))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["bos_token_id"] is None and cfg["num_hidden_layers"] == 1
    assert cfg["eos_token_id"] == Tokenizer.from_file(str(d / "tokenizer.json")).token_to_id(
        "<|im_end|>"
    )


def test_safetensors_layout(tmp_path: Path) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1.5], dtype=np.float32)
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": a, "b": b}, metadata={"format": "pt"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = read_safetensors_header(path)
    assert header["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert header["b"] == {"dtype": "F32", "shape": [1], "data_offsets": [24, 28]}
    assert header["__metadata__"] == {"format": "pt"}
    assert len(raw) == 8 + n + 28
    back = load_file(path)
    assert np.array_equal(back["a"], a) and np.array_equal(back["b"], b)
    with pytest.raises(TypeError):
        write_safetensors(tmp_path / "y", {"c": np.zeros(2, dtype=np.float64)})  # type: ignore[dict-item]


def test_cli_builds_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    assert main(["replica", "tiny-model", "--out", str(out), "--template", "chatml"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
