"""docker-compose.yml: valid Compose (docker compose config where a client works, the Compose
spec's own parser always), no secrets in the file, and the stack docs/DEPLOYMENT.md promises."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from django.conf import settings

from morphoweb.checks import MIN_SECRET_KEY_LENGTH, secret_key_problem
from morphoweb.frontend import SPOOL_MEMORY_BYTES
from tests.conftest import REPO

COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
SECRET_NAMES = re.compile(r"SECRET|PASSWORD|TOKEN|PRIVATE", re.IGNORECASE)
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def env_example() -> dict:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def interpolate(node, env: dict):
    """Compose's variable substitution: ${X}, ${X:-default} (unset or empty), ${X-default}
    (unset only), ${X:?error} (unset or empty), ${X?error} (unset only), $$ for a literal $."""
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value, env) for value in node]
    if not isinstance(node, str):
        return node

    def substitute(match):
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.groups()
        value = env.get(name)
        missing = value is None if op in ("-", "?") else not value
        if op in (":?", "?") and missing:
            raise KeyError(f"{name}: {arg}")
        if op in (":-", "-") and missing:
            return arg
        return value or ""

    return _VAR.sub(substitute, node)


def compose(env=None) -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env_example() if env is None else env)


def in_profile(config: dict, profile: str) -> dict:
    return {name: svc for name, svc in config["services"].items()
            if not svc.get("profiles") or profile in svc["profiles"]}


def test_the_file_is_valid_compose_spec():
    compose_spec = pytest.importorskip("compose_spec")
    compose_spec.PyCompose.from_json(json.dumps(compose()))
    broken = compose()
    broken["services"]["party-a"]["healthcheck"]["intervall"] = "5s"
    with pytest.raises(ValueError, match="intervall"):
        compose_spec.PyCompose.from_json(json.dumps(broken))


def _client():
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        probe = subprocess.run(argv + ["version"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return argv
    return None


@pytest.mark.processes
def test_docker_compose_config_accepts_it_and_demands_the_secrets(tmp_path):
    client = _client()
    if client is None:
        pytest.skip("no working docker compose client here (the spec check above still ran)")
    ok = subprocess.run(client + ["--env-file", str(ENV_EXAMPLE), "config", "-q"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    empty = tmp_path / "empty.env"
    empty.write_text("")
    missing = subprocess.run(client + ["--env-file", str(empty), "config", "-q"], cwd=REPO,
                             capture_output=True, text=True, timeout=120,
                             env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert missing.returncode != 0
    assert "set POSTGRES_PASSWORD in .env" in missing.stderr or "set PARTY_A_SECRET_KEY in .env" in missing.stderr


def test_no_secret_is_written_in_the_file():
    raw = yaml.safe_load(COMPOSE.read_text())
    for name, service in raw["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if SECRET_NAMES.search(key):
                assert re.fullmatch(r"\$\{\w+:\?[^}]+\}", str(value)), f"{name}.{key} = {value!r}"
            if key == "DATABASE_URL":
                assert "${POSTGRES_PASSWORD:?" in value, f"{name}: the password must come from .env"
    with pytest.raises(KeyError, match="in .env"):
        compose(env={})
    for key, value in env_example().items():
        if SECRET_NAMES.search(key):
            assert value.startswith("change-me"), f".env.example {key} must be a placeholder"


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_both_parties_with_a_worker_each_health_checks_and_named_volumes(profile):
    config = compose()
    services = in_profile(config, profile)
    engines = {name: svc for name, svc in services.items() if name.startswith("engine-")}
    webs = {name: svc for name, svc in services.items() if name.startswith("party-")}
    workers = {name: svc for name, svc in services.items() if name.startswith("worker-")}
    assert len(engines) == 2 and len(webs) == 2 and len(workers) == 2

    def devices(svc) -> list:
        return svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])

    # Only the engine servers hold a GPU: one per party, whatever the number of web processes.
    engine_hosts = {}
    for name, svc in engines.items():
        if profile == "gpu":
            assert devices(svc)[0]["driver"] == "nvidia" and "gpu" in devices(svc)[0]["capabilities"]
            assert svc["environment"]["MORPHO_ENGINE_BACKEND"] == "cuda"
            host = name
        else:
            assert not devices(svc) and svc["environment"]["MORPHO_ENGINE_BACKEND"] == "cpu", name
            host = svc["networks"]["default"]["aliases"][0]
        assert svc["command"][-3:] == ["serve_engine", "--url", "tcp://*:5555"]
        assert "matrix:/data:ro" in svc["volumes"] and svc["healthcheck"]["test"], name
        assert "ports" not in svc, f"{name}: the engine socket has no authentication of its own"
        engine_hosts[svc["environment"]["DATABASE_URL"].rsplit("/", 1)[1]] = host
    assert engine_hosts == {"party_a": "engine-a", "party_b": "engine-b"}
    for name, svc in {**webs, **workers}.items():
        assert not devices(svc), f"{name} must not reserve a GPU: its engine server has it"
        party = svc["environment"]["DATABASE_URL"].rsplit("/", 1)[1]
        assert svc["environment"]["MORPHO_ENGINE_URL"] == f"tcp://{engine_hosts[party]}:5555", name
        assert svc["environment"]["MORPHO_ENV"] == "production"
        assert svc["healthcheck"]["test"], name
    # Prometheus finds each party under the same name whichever profile runs.
    assert set(webs) == {"party-a", "party-b"}
    scrape = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    assert targets == {"party-a:8000", "party-b:8000"}
    for infra in ("postgres", "redis", "prometheus"):
        assert services[infra]["healthcheck"]["test"]
    assert set(config["volumes"]) >= {"matrix", "pgdata", "redisdata"}
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    # Parties never share a database or a broker.
    urls = {svc["environment"]["DATABASE_URL"].rsplit("/", 1)[1] for svc in webs.values()}
    brokers = {svc["environment"]["CELERY_BROKER_URL"] for svc in webs.values()}
    assert urls == {"party_a", "party_b"} and len(brokers) == 2


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_each_party_is_published_only_through_its_buffering_proxy(profile):
    """Slow clients: the published ports are nginx's, which reads requests whole
    before the web container sees them; the web containers count clients by the address nginx
    appends to X-Forwarded-For."""
    services = in_profile(compose(), profile)
    published = {}
    for party in ("a", "b"):
        web, proxy = services[f"party-{party}"], services[f"proxy-{party}"]
        assert "ports" not in web, f"party-{party} must be reached through proxy-{party} only"
        assert web["environment"]["MORPHO_NUM_PROXIES"] == "1"
        assert proxy["image"].startswith("nginx:")
        assert ("./deploy/nginx/party.conf.template:/etc/nginx/templates/default.conf.template:ro"
                in proxy["volumes"])
        assert proxy["environment"]["MORPHO_WEB_UPSTREAM"] == f"party-{party}:8000"
        assert proxy["environment"]["MORPHO_PROXY_PORT"] == "8000"
        assert proxy["depends_on"] == {f"party-{party}": {"condition": "service_started"}}
        assert proxy["healthcheck"]["test"]
        # The proxy refuses exactly the bodies its web server would.
        for limit in ("MORPHO_MAX_BODY_BYTES", "MORPHO_BULK_MAX_BODY_BYTES"):
            assert proxy["environment"][limit] == web["environment"][limit]
        published[party] = proxy["ports"]
    assert published == {"a": ["127.0.0.1:8001:8000"], "b": ["127.0.0.1:8002:8000"]}
    assert not [name for name, svc in services.items()
                if svc.get("ports") and not name.startswith("proxy-") and name != "prometheus"]


def test_the_proxy_limits_are_the_services():
    """deploy/nginx's deadlines and sizes are the front end's settings (morphoweb/frontend.py)
    and the service's body limits, so `make run` and compose hold slow clients alike."""
    conf = (REPO / "deploy" / "nginx" / "party.conf.template").read_text()

    def directive(name: str) -> str:
        values = re.findall(rf"^\s*{name}\s+([^;]+);", conf, re.MULTILINE)
        assert len(values) == 1, (name, values)
        return values[0]

    assert directive("client_header_timeout") == f"{settings.MORPHO_FRONTEND_HEADER_TIMEOUT:g}s"
    assert directive("client_body_timeout") == f"{settings.MORPHO_FRONTEND_BODY_TIMEOUT:g}s"
    assert directive("keepalive_timeout") == f"{settings.MORPHO_FRONTEND_KEEPALIVE_TIMEOUT:g}s"
    assert directive("send_timeout") == f"{settings.MORPHO_FRONTEND_SEND_TIMEOUT:g}s"
    assert directive("proxy_read_timeout") == f"{settings.MORPHO_FRONTEND_UPSTREAM_TIMEOUT:g}s"
    count, size = directive("large_client_header_buffers").split()
    assert int(count) * int(size.rstrip("k")) * 1024 == settings.MORPHO_FRONTEND_MAX_HEADER_BYTES
    assert directive("client_body_buffer_size") == f"{SPOOL_MEMORY_BYTES >> 20}m"
    assert directive("proxy_request_buffering") == "on" and directive("proxy_buffering") == "on"
    assert "X-Forwarded-For $proxy_add_x_forwarded_for" in conf
    limits = re.findall(r"client_max_body_size\s+\$\{(\w+)\};", conf)
    assert limits == ["MORPHO_MAX_BODY_BYTES", "MORPHO_BULK_MAX_BODY_BYTES"]
    defaults = compose()["x-body-limits"]
    assert defaults == {"MORPHO_MAX_BODY_BYTES": str(settings.MORPHO_MAX_BODY_BYTES),
                        "MORPHO_BULK_MAX_BODY_BYTES": str(settings.MORPHO_BULK_MAX_BODY_BYTES)}


def test_env_example_states_the_rules_the_parties_enforce():
    """What .env.example tells an operator is what the code does: the secret key's length, the
    command that makes one, and one GPU per party."""
    text = ENV_EXAMPLE.read_text()
    said = re.search(r"secret key shorter than\s*#?\s*(\d+) characters", text)
    assert said and int(said.group(1)) == MIN_SECRET_KEY_LENGTH, said
    maker = re.search(r"#\s+(python3 -c '.*')$", text, re.MULTILINE).group(1)
    made = subprocess.run(["sh", "-c", maker], capture_output=True, text=True, check=True).stdout
    assert secret_key_problem(made.strip()) is None
    values = env_example()
    for key in ("PARTY_A_SECRET_KEY", "PARTY_B_SECRET_KEY"):
        assert secret_key_problem(values[key]) is not None  # a placeholder is refused
    assert values["MORPHO_GPU_A"] != values["MORPHO_GPU_B"]
    unset = {k: v for k, v in values.items() if not k.startswith("MORPHO_GPU_")}
    gpus = {name: svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name, svc in in_profile(compose(unset), "gpu").items() if name.startswith("engine-")}
    assert gpus["engine-a"] != gpus["engine-b"]  # the file's own defaults too
