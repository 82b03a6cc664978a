"""Configuration: sources and their priority, and errors that name the bad field."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import ConfigError, RedisIndexSettings, RouterSettings

URL = "http://127.0.0.1:9001"


def test_defaults_and_replica_id() -> None:
    s = RouterSettings.load(env={}, cli={"replicas": [{"url": URL + "/"}]})
    assert s.replicas[0].url == URL and s.replicas[0].id == "127.0.0.1:9001"
    assert s.policy == "kv" and s.policy_header == "X-KVRoute-Policy"
    assert s.index.backend == "memory"
    assert RouterSettings.load(env={}, cli={"replicas": [{"url": "http://h"}]}).replicas[0].id \
        == "h:80"
    # every field documents itself
    for model in (RouterSettings, type(s.timeouts), type(s.health), type(s.failover)):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"


def test_priority_yaml_env_cli(tmp_path: Path) -> None:
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(
        "replicas:\n  - url: http://10.0.0.1:8000\n    id: one\n    models: [m]\n"
        "policy: random\ntimeouts:\n  connect_s: 5\n  stream_read_s: 7\n"
        "index:\n  backend: redis\n  url: redis://r:6379/1\n"
    )
    s = RouterSettings.load(config_file=cfg, env={})
    assert s.replicas[0].id == "one" and s.replicas[0].models == ["m"]
    assert isinstance(s.index, RedisIndexSettings) and s.index.url == "redis://r:6379/1"
    env = {"KVROUTE_TIMEOUTS__CONNECT_S": "2", "KVROUTE_POLICY": "least_loaded"}
    s = RouterSettings.load(config_file=cfg, env=env)
    assert s.timeouts.connect_s == 2 and s.timeouts.stream_read_s == 7  # merged, not replaced
    assert s.policy == "least_loaded"
    s = RouterSettings.load(config_file=cfg, env=env, cli={"policy": "round_robin",
                                                          "replicas": [{"url": URL}]})
    assert s.policy == "round_robin" and [r.url for r in s.replicas] == [URL]


def test_settings_are_frozen() -> None:
    s = RouterSettings.load(env={}, cli={"replicas": [{"url": URL}]})
    with pytest.raises(ValueError):
        s.policy = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("yaml_text", "env", "cli", "needle"),
    [
        ("timeouts:\n  connect_s: -1\n", {}, {}, "timeouts.connect_s"),
        ("", {"KVROUTE_HEALTH__FAILS_TO_DOWN": "0"}, {}, "health.fails_to_down"),
        ("", {}, {"replicas": [{"url": "ftp://x"}]}, "replicas.0.url"),
        ("", {"KVROUTE_INDEX__BACKEND": "etcd"}, {}, "index"),
        ("replicas:\n  - url: http://a:1\n  - url: http://a:1\n", {}, {}, "duplicate"),
        ("bogus: 1\n", {}, {}, "bogus"),
        ("", {}, {"port": 70000}, "port"),
        ("", {"KVROUTE_SESSION_HEADER": "a b"}, {}, "session_header"),
    ],
)
def test_errors_name_the_field_and_source(tmp_path: Path, yaml_text: str, env: dict[str, str],
                                          cli: dict[str, object], needle: str) -> None:
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(yaml_text or "replicas:\n  - url: http://127.0.0.1:1\n")
    if yaml_text and "replicas" not in yaml_text:
        cfg.write_text("replicas:\n  - url: http://127.0.0.1:1\n" + yaml_text)
    with pytest.raises(ConfigError) as info:
        RouterSettings.load(config_file=cfg, env=env, cli=cli)
    message = str(info.value)
    assert needle in message
    source = ("environment" if env else "command line" if cli else "config file")
    if needle not in ("duplicate",):
        assert source in message, message


def test_missing_replicas_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="replicas: at least one replica"):
        RouterSettings.load(env={})
    with pytest.raises(ConfigError, match="cannot read"):
        RouterSettings.load(config_file=tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        RouterSettings.load(config_file=bad, env={})
    bad.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        RouterSettings.load(config_file=bad, env={})
    with pytest.raises(ConfigError, match="KVROUTE"):
        RouterSettings.load(env={"KVROUTE_REPLICAS": "[not json"})


def test_unknown_policy_is_a_config_error() -> None:
    s = RouterSettings.load(env={}, cli={"replicas": [{"url": URL}], "policy": "nope"})
    with pytest.raises(ConfigError, match="policy: unknown policy 'nope'"):
        create_app(s, registry=CollectorRegistry())
