"""Scoring and model settings are declared once and passed through by name: the policy's
``KvConfig`` (with ``ScoringWeights``, ``CostModel`` and ``OutlookSettings``) and the
renderers' ``ModelSpec`` (and its ``RenderOptions``) carry exactly what the settings
say."""

from __future__ import annotations

import dataclasses
from typing import Any

from prompt.registry import ModelSpec
from router.config import ModelSettings, ScoringSettings
from router.fleet_outlook import OutlookSettings
from router.kv_policy import KvConfig
from router.kv_services import copy_fields, kv_config
from router.scoring import CostModel, ScoringWeights


def _names(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_defaults_agree_with_the_scoring_dataclasses() -> None:
    assert kv_config(ScoringSettings()) == KvConfig()


def test_every_scoring_knob_passes_through() -> None:
    changed: dict[str, Any] = {}
    for cls in (ScoringWeights, CostModel, OutlookSettings, KvConfig):
        for name in _names(cls):
            if name in ("weights", "costs", "outlook"):
                continue
            default = getattr(ScoringSettings(), name)
            if isinstance(default, bool):
                changed[name] = not default
            elif isinstance(default, float) and 0 < default <= 1:
                changed[name] = default / 2  # trusts and spreads are bounded by 1
            else:
                changed[name] = default + 1
    config = kv_config(ScoringSettings.model_validate(changed))
    for name, value in changed.items():
        holder = (config.weights if name in _names(ScoringWeights)
                  else config.costs if name in _names(CostModel)
                  else config.outlook if name in _names(OutlookSettings) else config)  # fmt: skip
        assert getattr(holder, name) == value, name


def test_model_settings_pass_through_to_the_spec_and_render_options(tmp_path: Any) -> None:
    settings = ModelSettings(
        name="m", block_size=32, tokenizer="/tok", chat_template="{{ messages }}",
        content_format="openai", default_chat_template_kwargs={"enable_thinking": False},
        max_model_len=4096, loras=["a", "b"],
    )  # fmt: skip
    spec = copy_fields(ModelSpec, settings.model_dump(), loras=tuple(settings.loras))
    assert spec == ModelSpec(
        name="m", block_size=32, tokenizer="/tok", chat_template="{{ messages }}",
        content_format="openai", default_chat_template_kwargs={"enable_thinking": False},
        max_model_len=4096, loras=("a", "b"),
    )  # fmt: skip
    options = spec.render_options()
    assert (options.chat_template, options.content_format, options.max_model_len) == (
        "{{ messages }}", "openai", 4096)
    assert dict(options.default_chat_template_kwargs) == {"enable_thinking": False}


def test_copy_fields_refuses_a_missing_attribute() -> None:
    @dataclasses.dataclass
    class Two:
        a: int = 0
        b: int = 0

    class OnlyA:
        a = 1

    try:
        copy_fields(Two, OnlyA())
    except AttributeError as exc:
        assert "b" in str(exc)
    else:
        raise AssertionError("expected AttributeError")
    assert copy_fields(Two, {"a": 5}) == Two(a=5, b=0)
