"""docker-compose.yml, deploy/router.yaml and deploy/prometheus/prometheus.yml, checked
without a Docker engine.

* The compose file against the compose specification's JSON schema (the copy that
  ``check-jsonschema`` vendors as ``vendor.compose-spec``), with a broken copy as a
  negative control so the check is known to bite.
* The stack's shape: pinned images, two replicas per profile behind the same network
  aliases, one GPU per vLLM replica, two routers on one Redis index, loopback-only ports,
  bind mounts that exist, dependencies that exist.
* Every kvroute command line in it parses with kvroute's real parser; every vLLM command
  line carries the flags kvroute relies on (vLLM's own parser checks them in the e2e step,
  ``tests/e2e/test_router_e2e.py``, where the vLLM environment exists).
* Each profile's router config loads with ``RouterSettings`` and names the replicas,
  ports, event endpoints, model name, block size and tokenizer its replicas really use.
* Prometheus scrapes every router and replica at the port it listens on.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from router.config import RouterSettings

VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
"""The vLLM release ``docs/vllm-interfaces.md`` is written against."""
REPLICA_ALIASES = {"replica-a", "replica-b"}
ROUTER_NAMES = {"router-1", "router-2"}
ROUTER_CONFIG_MOUNT = "/etc/kvroute/router.yaml"

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose variable interpolation with an empty environment: defaults only."""
    return _VAR.sub(lambda m: m.group("default") or "", value)


def command(service: dict[str, Any]) -> list[str]:
    """A service's ``command`` as an argv list."""
    raw = service.get("command", [])
    parts = raw.split() if isinstance(raw, str) else raw
    return [interpolate(str(p)) for p in parts]


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``name V`` or ``name=V`` in ``argv`` (the last one wins)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def aliases(service: dict[str, Any]) -> set[str]:
    """The service's network aliases on all its networks."""
    networks = service.get("networks") or {}
    out: set[str] = set()
    if isinstance(networks, dict):
        for net in networks.values():
            out.update((net or {}).get("aliases", []))
    return out


def is_kvroute(service: dict[str, Any]) -> bool:
    """Built from deploy/Dockerfile (ENTRYPOINT kvroute)."""
    build = service.get("build")
    return isinstance(build, dict) and build.get("dockerfile") == "deploy/Dockerfile"


def is_vllm(service: dict[str, Any]) -> bool:
    """Runs the vLLM OpenAI image (ENTRYPOINT ``vllm serve``)."""
    return str(service.get("image", "")).startswith("vllm/vllm-openai:")


def listen_port(service: dict[str, Any]) -> int:
    """The HTTP port a kvroute or vLLM service listens on (its ``--port``)."""
    port = flag(command(service), "--port")
    assert port is not None, f"{command(service)} has no --port"
    return int(port)


def kv_events(service: dict[str, Any]) -> dict[str, Any]:
    """A vLLM service's ``--kv-events-config`` JSON."""
    raw = flag(command(service), "--kv-events-config")
    assert raw is not None, "vLLM replica without --kv-events-config"
    cfg = json.loads(raw)
    assert isinstance(cfg, dict)
    return cfg


def bound_port(endpoint: str) -> int:
    """The port of a bound ZMQ endpoint ``tcp://*:P``."""
    m = re.fullmatch(r"tcp://\*:(\d+)", endpoint)
    assert m, f"{endpoint!r} is not a wildcard-bound tcp endpoint"
    return int(m.group(1))


def profile(service: dict[str, Any]) -> str | None:
    """The one profile of a replica service, else None."""
    profiles = service.get("profiles") or []
    assert len(profiles) <= 1, f"a service in several profiles: {profiles}"
    return profiles[0] if profiles else None


def replicas_by_profile(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """``{profile: {alias: service name}}`` for the services carrying a replica alias."""
    out: dict[str, dict[str, str]] = {}
    for name, svc in services.items():
        for alias in aliases(svc) & REPLICA_ALIASES:
            prof = profile(svc)
            assert prof is not None, f"replica service {name} must belong to a profile"
            assert alias not in out.setdefault(prof, {}), f"two {alias} in profile {prof}"
            out[prof][alias] = name
    return out


def parse_kvroute(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse with kvroute's parser; a usage error becomes a test failure with its message."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"kvroute rejects {argv}: exit {exc.code} (see stderr)")


# --- the compose specification --------------------------------------------------------------


def check_compose_schema(path: Path) -> subprocess.CompletedProcess[str]:
    """Validate ``path`` with the compose specification's JSON schema."""
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_compose_file_matches_the_compose_specification(repo: Path) -> None:
    result = check_compose_schema(repo / "docker-compose.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("services", "router-1", "comand"), ["serve"]),  # a misspelt key
        (("services", "redis", "ports"), {"6379": 6379}),  # a wrong type
        (("services", "router-1", "depends_on", "redis", "condition"), "service_up"),  # enum
    ],
)
def test_the_schema_check_rejects_a_broken_compose_file(
    compose: dict[str, Any], tmp_path: Path, path: tuple[str, ...], value: object
) -> None:
    broken = json.loads(json.dumps(compose))
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    target = tmp_path / "docker-compose.yml"
    target.write_text(yaml.safe_dump(broken), encoding="utf-8")
    result = check_compose_schema(target)
    assert result.returncode != 0, f"schema accepted {path}={value!r}"


# --- the stack's shape ----------------------------------------------------------------------


def test_images_are_pinned(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        image = str(svc.get("image", ""))
        assert image, f"{name} has no image"
        if is_kvroute(svc):
            assert svc["build"]["context"] == ".", name
            continue
        repo_name, _, tag = image.rpartition(":")
        assert repo_name and tag and tag != "latest", f"{name}: unpinned image {image}"
    vllm = [svc["image"] for svc in services.values() if is_vllm(svc)]
    assert vllm and set(vllm) == {VLLM_IMAGE}


def test_each_profile_has_two_replicas_behind_the_same_aliases(
    services: dict[str, dict[str, Any]],
) -> None:
    by_profile = replicas_by_profile(services)
    assert set(by_profile) == {"gpu", "sim"}
    for prof, members in by_profile.items():
        assert set(members) == REPLICA_ALIASES, prof
    assert all(is_vllm(services[n]) for n in by_profile["gpu"].values())
    assert all(is_kvroute(services[n]) for n in by_profile["sim"].values())
    for name in by_profile["sim"].values():
        assert command(services[name])[0] == "sim", name


def test_each_vllm_replica_reserves_its_own_gpu(services: dict[str, dict[str, Any]]) -> None:
    seen: set[str] = set()
    vllm = {n: s for n, s in services.items() if is_vllm(s)}
    assert len(vllm) >= 2
    for name, svc in vllm.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        device = devices[0]
        assert "gpu" in device["capabilities"] and device.get("driver") == "nvidia", name
        ids = set(device["device_ids"])
        assert ids and not ids & seen, f"{name} shares a GPU: {ids}"
        seen |= ids
        assert svc.get("ipc") == "host", f"{name}: vLLM needs shared memory (ipc: host)"


def test_vllm_replicas_run_with_what_kvroute_relies_on(
    services: dict[str, dict[str, Any]],
) -> None:
    topics: set[str] = set()
    served: set[str] = set()
    for name, svc in services.items():
        if not is_vllm(svc):
            continue
        argv = command(svc)
        assert not argv[0].startswith("-"), f"{name}: the model comes first (vllm serve MODEL)"
        assert argv[0] != "serve", f"{name}: the image's entrypoint is already 'vllm serve'"
        assert "--enable-prefix-caching" in argv, name
        assert "--enable-prompt-tokens-details" in argv, name
        assert flag(argv, "--host") == "0.0.0.0", name
        block = flag(argv, "--block-size")
        assert block is not None and int(block) > 0, name
        name_flag = flag(argv, "--served-model-name")
        assert name_flag, name
        served.add(name_flag)
        cfg = kv_events(svc)
        assert cfg["enable_kv_cache_events"] is True, name
        assert cfg["publisher"] == "zmq", name
        assert bound_port(cfg["endpoint"]) != bound_port(cfg["replay_endpoint"]), name
        assert cfg["topic"] not in topics, f"{name}: topic shared with another replica"
        topics.add(cfg["topic"])
    assert len(served) == 1, f"replicas serve different model names: {served}"


def test_kvroute_commands_parse_with_the_real_cli(
    services: dict[str, dict[str, Any]], kvroute_parser: argparse.ArgumentParser
) -> None:
    commands = {n: command(s) for n, s in services.items() if is_kvroute(s)}
    assert {argv[0] for argv in commands.values()} >= {"serve", "sim"}
    for name, argv in commands.items():
        args = parse_kvroute(kvroute_parser, argv)
        assert args.command == argv[0], name
        if argv[0] in ("serve", "sim"):
            assert flag(argv, "--host") == "0.0.0.0", f"{name} must listen beyond loopback"


def test_kvroute_healthchecks_probe_the_port_the_service_listens_on(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, svc in services.items():
        if not is_kvroute(svc) or flag(command(svc), "--port") is None:
            continue
        url = urlsplit(svc["environment"]["HEALTHCHECK_URL"])
        assert url.hostname == "127.0.0.1" and url.path == "/health", name
        assert url.port == listen_port(svc), name


def routers_by_profile(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """``{profile: {network name: service name}}`` for the ``kvroute serve`` services."""
    out: dict[str, dict[str, str]] = {}
    for name, svc in services.items():
        if is_kvroute(svc) and command(svc)[0] == "serve":
            prof = profile(svc)
            assert prof is not None, f"router {name} must belong to a profile"
            for host in ({name} | aliases(svc)) & ROUTER_NAMES:
                assert host not in out.setdefault(prof, {}), f"two {host} in profile {prof}"
                out[prof][host] = name
    return out


def router_config_of(service: dict[str, Any], repo: Path) -> tuple[str, RouterSettings]:
    """The config file a router service mounts, and its settings as the router loads them."""
    assert flag(command(service), "--config") == ROUTER_CONFIG_MOUNT
    mounts = [v for v in service["volumes"] if v.endswith(f":{ROUTER_CONFIG_MOUNT}:ro")]
    assert len(mounts) == 1, service["volumes"]
    source = mounts[0].split(":", 1)[0]
    return source, RouterSettings.load(config_file=repo / source, env={})


def test_each_profile_has_two_routers_sharing_one_redis_index(
    services: dict[str, dict[str, Any]], repo: Path
) -> None:
    redis_cmd = command(services["redis"])
    assert flag(redis_cmd, "--maxmemory-policy") == "volatile-lru", "index keys carry TTLs"
    by_profile = routers_by_profile(services)
    assert set(by_profile) == {"gpu", "sim"}
    for prof, members in by_profile.items():
        assert set(members) == ROUTER_NAMES, prof
        configs = {router_config_of(services[n], repo)[0] for n in members.values()}
        assert len(configs) == 1, f"{prof}: the routers must share one config: {configs}"
        for name in members.values():
            svc = services[name]
            deps = svc["depends_on"]
            assert deps["redis"]["condition"] == "service_healthy", name
            replicas = replicas_by_profile(services)[prof].values()
            assert all(deps[r]["condition"] == "service_healthy" for r in replicas), name
            settings = router_config_of(svc, repo)[1]
            assert settings.policy == "kv", name
            assert settings.index.backend == "redis", name
            url = urlsplit(settings.index.url)
            assert url.hostname == "redis" and url.port in (None, 6379), name
            assert settings.index.key_prefix == "kvroute:", "one namespace for all routers"


def test_router_configs_name_what_their_profile_provides(
    services: dict[str, dict[str, Any]], repo: Path
) -> None:
    replicas = replicas_by_profile(services)
    for prof, members in routers_by_profile(services).items():
        router = services[next(iter(members.values()))]
        _, settings = router_config_of(router, repo)
        assert {r.id for r in settings.replicas} == REPLICA_ALIASES, prof
        (model,) = settings.scoring.models
        for replica in settings.replicas:
            url = urlsplit(replica.url)
            assert url.hostname == replica.id, "the replica id is its compose alias"
            svc = services[replicas[prof][replica.id]]
            argv = command(svc)
            assert url.port == listen_port(svc), (prof, replica.id)
            if is_vllm(svc):
                cfg = kv_events(svc)
                events, replay = cfg["endpoint"], cfg["replay_endpoint"]
                assert model.name == flag(argv, "--served-model-name"), prof
                assert model.max_model_len == int(flag(argv, "--max-model-len") or 0), prof
                assert model.tokenizer == argv[0], "the tokenizer of the served model"
            else:
                events = flag(argv, "--kv-events-endpoint")
                replay = flag(argv, "--replay-endpoint")
                assert events is not None and replay is not None, "fixed endpoints"
                assert model.name == flag(argv, "--model"), prof
                assert model.tokenizer == flag(argv, "--tokenizer"), prof
            assert model.block_size == int(flag(argv, "--block-size") or 0), (prof, "block size")
            assert replica.kv_events_endpoint == f"tcp://{replica.id}:{bound_port(events)}"
            assert replica.replay_endpoint == f"tcp://{replica.id}:{bound_port(replay)}"


def test_routers_can_read_their_tokenizers(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        if not (is_kvroute(svc) and command(svc)[0] == "serve"):
            continue
        volumes = svc["volumes"]
        if profile(svc) == "gpu":
            assert "hf-cache:/home/kvroute/.cache/huggingface:ro" in volumes, name
        else:
            assert "models:/models:ro" in volumes, name
    writer = services["tiny-model"]
    assert command(writer)[:2] == ["replica", "tiny-model"]
    assert flag(command(writer), "--out") == "/models/tiny-llama"
    assert "models:/models" in writer["volumes"]


def test_published_ports_are_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_bind_mounts_exist_and_named_volumes_are_declared(
    compose: dict[str, Any], repo: Path
) -> None:
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if source.startswith("./"):
                assert (repo / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared, f"{name} uses undeclared volume {source}"


def test_dependencies_exist_in_every_profile_that_needs_them(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown service {dep}"
            needed = set(svc.get("profiles") or [])
            provided = set(services[dep].get("profiles") or [])
            assert not provided or (needed and needed <= provided), (
                f"{name} depends on {dep}, which its profiles {needed or 'default'} lack"
            )


# --- Prometheus -----------------------------------------------------------------------------


def test_prometheus_scrapes_every_router_and_replica(
    services: dict[str, dict[str, Any]], repo: Path
) -> None:
    config = yaml.safe_load((repo / "deploy/prometheus/prometheus.yml").read_text("utf-8"))
    mount = "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    assert mount in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command(services["prometheus"])
    names: dict[str, list[dict[str, Any]]] = {}
    for name, svc in services.items():
        for host in {name} | aliases(svc):
            names.setdefault(host, []).append(svc)
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                assert host in names, f"job {job['job_name']}: {host} is no compose service"
                for svc in names[host]:
                    assert int(port) == listen_port(svc), f"{target} is not where {host} listens"
                scraped.add(host)
    assert scraped >= ROUTER_NAMES | REPLICA_ALIASES, scraped


# Top-level keys docker-compose 1.29 (v1, what Debian ships) accepts; anything else, such
# as the compose specification's `name:`, makes it reject the whole file.
COMPOSE_V1_TOP_LEVEL = {"version", "services", "networks", "volumes", "secrets", "configs"}


def test_compose_file_runs_under_compose_v1_and_v2(compose: dict[str, Any], repo: Path) -> None:
    extra = {k for k in compose if not k.startswith("x-")} - COMPOSE_V1_TOP_LEVEL
    assert not extra, f"docker-compose 1.29 rejects top-level {sorted(extra)}"
    # the project name both read (v2 would take `name:`, v1 cannot): .env in the project
    # directory, kept out of the image's build context
    env = dict(line.split("=", 1) for line in (repo / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env == {"COMPOSE_PROJECT_NAME": "kvroute"}
    assert ".env" in (repo / ".dockerignore").read_text().split()
