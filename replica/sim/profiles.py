"""Timing profiles of the simulated replica: how long one scheduler step takes.

A step's simulated duration is::

    step_s = step_overhead_s                                  # any step at all
           + prefill_tokens * prefill_s_per_token             # uncached prompt tokens this step
           + decode_seqs * decode_s_per_seq                   # sequences decoding this step
           + context_tokens * decode_s_per_context_token      # KV read by those sequences
           + host-tier load time (see ``replica.sim.offload``)

so TTFT grows with the *uncached* prompt tokens, which is what makes routing differences
visible.  Profiles also fix the scheduler limits (``max_num_batched_tokens``: the
per-step token budget used by chunked prefill; ``max_num_seqs``) and the KV geometry.

``llama-3.1-8b-h100`` -- Llama 3.1 8B Instruct, bf16, one H100 SXM 80 GB, vLLM V1:

* KV bytes per token = 2 (K,V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes
  = 131,072 B = 128 KiB (model config: num_hidden_layers=32, num_key_value_heads=8,
  head_dim=4096/32=128).  One 16-token block = 2 MiB.
* KV blocks: usable HBM 79.1 GiB x gpu_memory_utilization 0.9 = 71.2 GiB, minus weights
  (8.03e9 params x 2 B = 14.96 GiB) minus activations/CUDA graphs (~2.5 GiB) leaves
  ~53.7 GiB for KV = ~440k tokens = 27,500 blocks of 16 (vLLM logs "GPU KV cache size:
  ~440,000 tokens" for this setup; the figure depends on the vLLM version's profiling).
* Prefill: 2 x 8.03e9 = 16 GFLOP per token; H100 dense bf16 peak 989 TFLOP/s at ~40 %
  MFU gives ~25k tokens/s, i.e. 40 us per uncached token (in line with published vLLM
  TTFTs of ~45 ms for a 1k-token prompt on an idle H100).
* Decode: each step reads all weights once (14.96 GiB / 3.35 TB/s = 4.8 ms) plus
  scheduling, sampling and launch overhead (~1.2 ms), so ``step_overhead_s`` = 6 ms;
  each decoding sequence adds ~30 us (sampling, per-sequence kernels) and each token of
  context it attends to adds 128 KiB / 3.35 TB/s = 39 ns.  Batch 64 at 1k context:
  6 + 1.9 + 2.5 = ~10.4 ms per step, matching the 8-12 ms inter-token latency vLLM
  reports for 8B models on H100 at moderate load.
* Limits: vLLM 0.32's defaults for an H100 API server: ``max_num_batched_tokens`` 8192,
  ``max_num_seqs`` 1024 (``EngineArgs._default_max_num_seqs_and_batched_tokens``);
  max_model_len 131072 is the model's, the profile caps it at 32768 to keep KV sane.

``default`` -- a generic mid-range GPU with round figures (5 ms steps, 50k prefill
tokens/s), vLLM's non-H100 scheduler defaults (2048 / 256) and 4096 blocks of 16.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    """Rates and limits of one simulated accelerator + model."""

    name: str
    step_overhead_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    max_num_batched_tokens: int
    max_num_seqs: int
    num_gpu_blocks_16: int
    """KV blocks available at block size 16 (scaled for other block sizes)."""
    kv_bytes_per_token: int
    max_model_len: int

    def num_gpu_blocks(self, block_size: int) -> int:
        """Blocks available at ``block_size`` for the same KV memory."""
        return max(2, self.num_gpu_blocks_16 * 16 // block_size)

    def step_seconds(
        self, prefill_tokens: int, decode_seqs: int, context_tokens: int
    ) -> float:
        """Simulated duration of one step (without host-tier loads)."""
        return (
            self.step_overhead_s
            + prefill_tokens * self.prefill_s_per_token
            + decode_seqs * self.decode_s_per_seq
            + context_tokens * self.decode_s_per_context_token
        )


_KIB = 1024

PROFILES: dict[str, Profile] = {
    "default": Profile(
        name="default",
        step_overhead_s=0.005,
        prefill_s_per_token=20e-6,
        decode_s_per_seq=20e-6,
        decode_s_per_context_token=20e-9,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        num_gpu_blocks_16=4096,
        kv_bytes_per_token=128 * _KIB,
        max_model_len=8192,
    ),
    "llama-3.1-8b-h100": Profile(
        name="llama-3.1-8b-h100",
        step_overhead_s=0.006,
        prefill_s_per_token=40e-6,
        decode_s_per_seq=30e-6,
        decode_s_per_context_token=39e-9,
        max_num_batched_tokens=8192,
        max_num_seqs=1024,
        num_gpu_blocks_16=27_500,
        kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
        max_model_len=32768,
    ),
}


def get_profile(name: str) -> Profile:
    """The profile called ``name``; raises ``KeyError`` listing the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {sorted(PROFILES)}") from None
