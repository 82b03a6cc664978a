"""Replayed policies with changed scoring settings (``kvroute.replay.policy_spec``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.replay.loop import ReplayConfig
from kvroute.replay.policy_spec import PolicySpec, parse_policy
from router.config_scoring import ScoringSettings


def test_a_spec_names_a_policy_and_its_typed_overrides() -> None:
    assert parse_policy("session") == PolicySpec("session", "session")
    spec = parse_policy("kv/pool_headroom=false/stay_quantile=null/future_weight=0.5"
                        "/scrape.interval_s=2")
    assert spec.label == ("kv/pool_headroom=false/stay_quantile=null/future_weight=0.5"
                          "/scrape.interval_s=2")
    assert spec.name == "kv"
    assert spec.overrides == (("pool_headroom", False), ("stay_quantile", None),
                              ("future_weight", 0.5), ("scrape.interval_s", 2))
    scoring = spec.config(ReplayConfig(num_blocks=600)).scoring
    assert not scoring.pool_headroom and scoring.stay_quantile is None
    assert scoring.future_weight == 0.5 and scoring.scrape.interval_s == 2.0
    # Everything else as configured, and the base configuration untouched.
    assert scoring.price_future == ScoringSettings().price_future
    cfg = ReplayConfig(num_blocks=600)
    assert spec.config(cfg).num_blocks == 600 and cfg.scoring == ScoringSettings()
    assert parse_policy("kv").config(cfg) is cfg


@pytest.mark.parametrize(("spec", "says"), [
    ("kvx", "unknown policy 'kvx'"),
    ("kv/no_such_knob=1", "no_such_knob"),
    ("kv/pool_headroom=maybe", "pool_headroom"),
    ("kv/stay_quantile=2", "stay_quantile"),
    ("kv/pool_headroom", "not a key=value override"),
    ("kv/=1", "not a key=value override"),
    ("kv/alpha.beta=1", "no scoring section 'alpha'"),
])
def test_a_spec_that_the_router_would_refuse_is_refused_before_anything_runs(
    spec: str, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        parse_policy(spec)


def test_kvroute_replay_runs_a_changed_policy_beside_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "replay.json"
    assert main(["replay", "--sessions", "6", "--max-tokens", "8", "--num-blocks", "256",
                 "--policies", "kv,kv/pool_headroom=true,kv/temperature=2000",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 256 | kv/temperature=2000 |" in text
    points = {p["policy"]: p for p in json.loads(out.read_text())["points"]}
    assert list(points) == ["kv", "kv/pool_headroom=true", "kv/temperature=2000"]

    def figures(label: str) -> dict[str, object]:
        return {k: v for k, v in points[label].items() if k != "policy"}

    # The default written out changes nothing; sampling the choice changes the run.
    assert figures("kv/pool_headroom=true") == figures("kv")
    assert figures("kv/temperature=2000") != figures("kv")


def test_kvroute_replay_refuses_an_override_the_router_would_refuse(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--policies", "session,kv/pool_headroom=maybe"]) == 2
    assert "--policies: scoring override refused: pool_headroom" in capsys.readouterr().err
    assert main(["replay", "--policies", "kv,session,kv"]) == 2
    assert "--policies: a policy is given twice" in capsys.readouterr().err
