"""``kvroute sim``'s command line becomes the settings the server runs with."""

from __future__ import annotations

from kvroute.cli import build_parser
from replica.sim.main import settings_from_args


def test_sim_flags_reach_the_settings() -> None:
    args = build_parser().parse_args([
        "sim", "--model", "m", "--tokenizer", "/tok", "--port", "9001",
        "--block-size", "32", "--num-blocks", "65", "--time-scale", "0.01",
        "--profile", "llama-3.1-8b-h100", "--kv-events-endpoint", "tcp://*:5557",
        "--replay-endpoint", "tcp://*:5558", "--topic", "kv@a@m", "--legacy-event-encoding",
        "--cpu-offload-blocks", "128", "--fault-slow-first-token", "0.5",
        "--fault-drop-events", "2", "--lora-modules", "ad1", "ad2", "--seed", "7",
    ])
    s = settings_from_args(args)
    eng = s.engine_config()
    assert (s.model, s.tokenizer, s.port) == ("m", "/tok", 9001)
    assert (eng.block_size, eng.num_blocks, eng.time_scale, eng.seed) == (32, 65, 0.01, 7)
    assert eng.profile == "llama-3.1-8b-h100" and eng.cpu_offload_blocks == 128
    assert (s.kv_events_endpoint, s.replay_endpoint, s.topic) == (
        "tcp://*:5557", "tcp://*:5558", "kv@a@m")
    assert s.legacy_encoding and s.kv_events and s.enable_prompt_tokens_details
    assert s.faults.slow_first_token_s == 0.5 and s.faults.drop_events == 2
    assert s.lora_modules == ("ad1", "ad2")


def test_sim_defaults() -> None:
    args = build_parser().parse_args(["sim", "--model", "m", "--tokenizer", "/tok"])
    s = settings_from_args(args)
    eng = s.engine_config()
    assert eng.time_scale == 1.0 and eng.profile == "default" and eng.num_blocks is None
    assert s.kv_events_endpoint is None and s.replay_endpoint is None
    assert not s.legacy_encoding and s.lora_modules == ()
