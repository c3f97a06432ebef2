"""`vllm serve` command lines carry over to `pagoda serve`: vLLM's flags parse into pagoda's configs with
vLLM's meaning, flags pagoda lacks are refused by name, and one such command line serves the openai SDK
(over HTTPS, under a root path, with CORS)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.loader import resolve_model_dir
from server.cli import _engine_config, _server_config, build_parser

ROOT = Path(__file__).resolve().parents[1]

# (vLLM's command line, the config fields it sets: EngineConfig's or ServerConfig's).
VLLM_COMMAND_LINES = [
    ("vllm serve TheBloke/Llama-2-7B-AWQ --quantization awq", dict(quantization="awq")),
    ("vllm serve meta-llama/Llama-3.1-8B-Instruct -q fp8", dict(quantization="fp8")),
    (
        "vllm serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-dtype fp8 --calculate-kv-scales",
        dict(kv_cache_dtype="fp8", calculate_kv_scales=True),
    ),
    (
        "vllm serve Qwen/Qwen2.5-0.5B-Instruct --host 0.0.0.0 --port 8000 --dtype bfloat16 --max-model-len 4096 "
        "--gpu-memory-utilization 0.9 --served-model-name a b --api-key x --enable-prefix-caching --seed 0",
        dict(
            model="Qwen/Qwen2.5-0.5B-Instruct",
            host="0.0.0.0",
            port=8000,
            dtype="bfloat16",
            max_model_len=4096,
            gpu_memory_utilization=0.9,
            served_model_name=["a", "b"],
            api_key=["x"],
            enable_prefix_caching=True,
            seed=0,
        ),
    ),
    (
        "vllm serve NousResearch/Hermes-3-Llama-3.1-8B --enable-auto-tool-choice --tool-call-parser hermes "
        "--chat-template examples/tool_chat_template_hermes.jinja",
        dict(
            enable_auto_tool_choice=True,
            tool_call_parser="hermes",
            chat_template="examples/tool_chat_template_hermes.jinja",
        ),
    ),
    (
        "vllm serve meta-llama/Llama-3.1-8B-Instruct --disable-log-requests --max-num-batched-tokens 4096 "
        "--enable-chunked-prefill",
        dict(log_requests=False, max_num_batched_tokens=4096, enable_chunked_prefill=True),
    ),
    (
        "vllm serve Qwen/Qwen3-8B --reasoning-parser qwen3 --enable-log-requests --max-log-len 200 "
        "--generation-config vllm",
        dict(reasoning_parser="qwen3", log_requests=True, max_log_len=200, generation_config="vllm"),
    ),
    (
        """vllm serve m --allowed-origins '["https://app.example.com"]' --allowed-methods '["GET", "POST"]' """
        """--allowed-headers '["Authorization", "Content-Type"]' --allow-credentials""",
        dict(
            allowed_origins=("https://app.example.com",),
            allowed_methods=("GET", "POST"),
            allowed_headers=("Authorization", "Content-Type"),
            allow_credentials=True,
        ),
    ),
    (
        "vllm serve m --uvicorn-log-level warning --root-path /api --disable-fastapi-docs --disable-uvicorn-access-log",
        dict(uvicorn_log_level="warning", root_path="/api", disable_fastapi_docs=True, disable_uvicorn_access_log=True),
    ),
    (
        "vllm serve m -tp 1 --trust-remote-code --max-num-seqs 128",
        dict(tensor_parallel_size=1, trust_remote_code=True, max_num_seqs=128),
    ),
    (
        "vllm serve org/m --tokenizer org/tok --revision v1.0 --download-dir /data/hf --port 8443 "
        "--ssl-keyfile key.pem --ssl-certfile cert.pem",
        dict(
            model="org/m",
            tokenizer="org/tok",
            revision="v1.0",
            download_dir="/data/hf",
            port=8443,
            ssl_keyfile="key.pem",
            ssl_certfile="cert.pem",
        ),
    ),
    (
        "vllm serve m --tensor-parallel-size 1 --enforce-eager --swap-space 8 --block-size 32 --load-format dummy "
        "--no-enable-prefix-caching --dtype half --device cpu",
        dict(
            tensor_parallel_size=1,
            enforce_eager=True,
            swap_space=8.0,
            block_size=32,
            load_format="dummy",
            enable_prefix_caching=False,
            dtype="half",
            device="cpu",
        ),
    ),
    (
        "vllm serve --model m --served-model-name gpt-4o-mini --max-waiting-requests 100 --seed 1234",
        dict(model="m", served_model_name=["gpt-4o-mini"], max_waiting_requests=100, seed=1234),
    ),
    (
        "vllm serve Qwen/Qwen3-8B --speculative-config "
        """'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'""",
        dict(speculative_config=SpeculativeConfig("ngram", 5, prompt_lookup_min=4, prompt_lookup_max=4)),
    ),
]


def pagoda_configs(vllm_command_line: str) -> tuple:
    """`vllm serve ...` run as `pagoda serve ...`: (ServerConfig, EngineConfig)."""
    argv = shlex.split(vllm_command_line)
    assert argv[:2] == ["vllm", "serve"]
    args = build_parser().parse_args(["serve", *argv[2:]])
    return _server_config(args), _engine_config(args, args.model or args.model_flag)


@pytest.mark.parametrize("command_line, expected", VLLM_COMMAND_LINES, ids=range(len(VLLM_COMMAND_LINES)))
def test_vllm_command_lines_parse_into_pagoda_configs(command_line, expected):
    http, engine = pagoda_configs(command_line)
    for name, value in expected.items():
        config = http if hasattr(http, name) else engine
        assert getattr(config, name) == value, name


@pytest.mark.parametrize(
    "flags",
    [
        ["--enable-lora"],
        ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'],
        ["--pipeline-parallel-size", "2"],
        ["--data-parallel-size", "2"],
        ["--disable-log-stats"],
        ["--tokenizer-mode", "auto"],
        ["--enable-prefix"],  # a prefix of --enable-prefix-caching: refused, not taken for it
    ],
)
def test_flags_pagoda_lacks_are_refused_by_name(flags, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["serve", "m", "--port", "8000", *flags])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and flags[0] in err


@pytest.mark.parametrize("value", ["*", '{"origin": "*"}', "[1, 2]"])
def test_cors_lists_must_be_json_lists_of_strings(value, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["serve", "--allowed-origins", value])
    assert exit.value.code == 2
    assert "--allowed-origins" in capsys.readouterr().err


def test_more_than_one_gpu_is_refused_at_start_in_one_line():
    # The flags are checked before the port is bound: the refusal is the same while another process holds it.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = subprocess.run(
            [sys.executable, "-m", "server.cli", "serve", "-tp", "2", "--host", "127.0.0.1", "--port", port],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "pagoda serve: pagoda serves a model on one GPU: tensor_parallel_size (-tp) must be 1, got 2"
    ]
    with pytest.raises(ValueError, match="one GPU"):
        EngineConfig(device="cpu", tensor_parallel_size=4)


def hub_cache(root: Path, repo_id: str, files: Path, revision: str) -> str:
    """A Hugging Face cache under root holding repo_id's files at `revision` (a ref to a snapshot), as
    huggingface_hub lays one out; returns the snapshot's directory."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in files.iterdir():
        (snapshot / path.name).symlink_to(path)
    (repo / "refs").mkdir()
    (repo / "refs" / revision).write_text(commit)
    return str(snapshot)


def test_revision_and_download_dir_find_a_model_id_in_that_cache(tmp_path, default_model_dir):
    snapshot = hub_cache(tmp_path / "hf", "org/smol", Path(default_model_dir), "v1")
    assert resolve_model_dir("org/smol", "v1", str(tmp_path / "hf")) == snapshot
    assert resolve_model_dir(str(default_model_dir), "v1", str(tmp_path / "hf")) == str(default_model_dir)
    with pytest.raises(FileNotFoundError, match="org/smol is neither .* at revision v2"):
        resolve_model_dir("org/smol", "v2", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        resolve_model_dir("org/smol", "v1", str(tmp_path / "elsewhere"))


def test_tokenizer_from_another_directory(tiny_model_dir, default_model_dir):
    from engine.llm import LLM

    # The tiny random model has no tokenizer files of its own.
    llm = LLM(
        str(tiny_model_dir("llama")),
        tokenizer=str(default_model_dir),
        device="cpu",
        dtype="float32",
        num_gpu_blocks_override=16,
    )
    assert llm.tokenizer is not None
    assert llm.tokenizer.decode(llm.tokenizer.encode("Paris", add_special_tokens=False)) == "Paris"
    assert LLM(str(tiny_model_dir("llama")), device="cpu", num_gpu_blocks_override=16).tokenizer is None


# ----- one vLLM command line, served -----


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return key, cert


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, default_model_dir):
    """`pagoda serve` with a vLLM command line's flags: the default model as a hub id at a revision in a
    separate cache, HTTPS, a root path, CORS for one origin, two names."""
    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = self_signed_cert(folder)
    hub_cache(folder / "hf", "HuggingFaceTB/SmolLM2-135M-Instruct", Path(default_model_dir), "v1")
    port = _free_port()
    command_line = (
        f"vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --revision v1 --download-dir {folder / 'hf'} "
        f"--tokenizer {default_model_dir} --host 127.0.0.1 --port {port} --dtype float32 --max-model-len 512 "
        "-tp 1 --trust-remote-code --seed 0 --served-model-name smol smol-2 --root-path /api "
        """--allowed-origins '["https://app.example"]' --allow-credentials --disable-fastapi-docs """
        f"--enable-log-requests --uvicorn-log-level warning --ssl-keyfile {key} --ssl-certfile {cert} "
        "--num-gpu-blocks-override 64"
    )
    argv = [sys.executable, "-m", "server.cli", "serve", *shlex.split(command_line)[2:]]
    log_path = folder / "pagoda.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ))
    context = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        try:
            if httpx.get(f"{url}/health", verify=context, timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.25)
    yield url, context, log_path
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0, log_path.read_text()[-3000:]


def test_vllm_command_line_serves_the_sdk_over_https_under_the_root_path(tls_server):
    url, context, log_path = tls_server
    with httpx.Client(verify=context) as http:
        client = openai.OpenAI(base_url=f"{url}/api/v1", api_key="unused", http_client=http, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smol", "smol-2"]
        for name in ("smol", "smol-2"):
            chat = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0,
                max_tokens=8,
            )
            assert chat.choices[0].message.content.startswith("The capital of France is")
            assert chat.model == "smol"
        # Behind a proxy that strips the prefix, the routes answer without it too.
        assert http.get(f"{url}/v1/models").status_code == 200
        assert http.get(f"{url}/api/docs").status_code == 404  # --disable-fastapi-docs
        assert http.get(f"{url}/openapi.json").status_code == 404
    with pytest.raises(httpx.ConnectError):  # the self-signed certificate is trusted only when given
        httpx.get(f"{url}/health")
    assert f"ready at {url} (serving smol at /v1" in log_path.read_text()


def test_browsers_may_call_from_the_allowed_origin(tls_server):
    url, context, _ = tls_server
    origin = "https://app.example"
    with httpx.Client(verify=context) as http:
        preflight = http.options(
            f"{url}/api/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == origin
        assert preflight.headers["access-control-allow-credentials"] == "true"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        simple = http.get(f"{url}/api/v1/models", headers={"Origin": origin})
        assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == origin
        other = http.get(f"{url}/api/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        refused = http.options(
            f"{url}/api/v1/models",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"},
        )
        assert refused.status_code == 400
