"""`pagoda serve`'s flags, generated from ServerConfig and EngineConfig; README.md's flag table from the same
fields; `pagoda bench` as a plugin that engine/ and server/ never import."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from server.cli import _engine_config, _server_config, build_parser, flag_table, readme_flag_table
from server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]


def serve_actions() -> dict[str, object]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    actions = {}
    for action in serve._actions:  # a flag's first action: a bool's --disable-x spelling comes after its --enable-x
        actions.setdefault(action.dest, action)
    return actions


def test_readme_flag_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    table = readme_flag_table(readme)
    assert table is not None, "README.md lost the flag table's markers; see server/cli.py (_TABLE_START, _TABLE_END)"
    assert table == flag_table(), (
        "README.md's flag table differs from the flags' fields (ServerConfig, EngineConfig): "
        "regenerate it with `python -m server.cli flag-table --write`"
    )


def test_every_config_field_has_help_and_a_flag():
    actions = serve_actions()
    for cls in (ServerConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
            assert f.name in actions, f"{cls.__name__}.{f.name} has no flag"
            action = actions[f.name]
            if f.name != "model":
                flags = f.metadata.get("flags", ["--" + f.name.replace("_", "-")])
                assert action.option_strings[: len(flags)] == list(flags)
                assert action.default == f.default
                assert f.metadata["help"] in action.help.replace("%%", "%")
            if "choices" in f.metadata:
                assert list(action.choices) == list(f.metadata["choices"])


def test_no_flags_give_the_configs_defaults():
    args = build_parser().parse_args(["serve"])
    assert _engine_config(args, None) == EngineConfig()
    assert _server_config(args) == ServerConfig()
    assert (args.model, args.model_flag) == (None, None)


def test_flags_reach_the_configs():
    args = build_parser().parse_args(
        [
            "serve",
            "/models/m",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--served-model-name",
            "x",
            "y",
            "--max-waiting-requests",
            "0",
            "--disable-uvicorn-access-log",
            "--uvicorn-log-level",
            "debug",
            "--device",
            "cpu",
            "--no-enable-chunked-prefill",
            "--async-scheduling",
            "--enforce-eager",
            "--max-model-len",
            "128",
            "--swap-space",
            "1.5",
            "--queue-timeout",
            "2",
            "--attention-backend",
            "torch",
        ]
    )
    http = _server_config(args)
    assert (http.api_key, http.served_model_name, http.max_waiting_requests) == (["a", "b"], ["x", "y"], 0)
    assert (http.disable_uvicorn_access_log, http.uvicorn_log_level, http.port) == (True, "debug", 8000)
    config = _engine_config(args, "/models/m")
    assert config.model == "/models/m" and args.model == "/models/m"
    assert (config.enable_chunked_prefill, config.enable_prefix_caching) == (False, True)
    assert (config.async_scheduling, config.enforce_eager, config.max_model_len) == (True, True, 128)
    assert (config.swap_space, config.queue_timeout, config.attention_backend) == (1.5, 2.0, "torch")
    assert build_parser().parse_args(["serve", "--model", "m"]).model_flag == "m"


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-num-seqs", "0"],
        ["--block-size", "x"],
        ["--max-waiting-requests", "-1"],
        ["--rate-limit-tokens-per-minute", "0"],
        ["--dtype", "int8"],
        ["--preemption-mode", "never"],
    ],
)
def test_bad_flag_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["serve", *argv])
    assert exit.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_engine_and_server_import_nothing_from_bench():
    for path in [*(ROOT / "engine").rglob("*.py"), *(ROOT / "server").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not any(n == "bench" or n.startswith("bench.") for n in names), f"{path} imports {names}"


def test_pagoda_bench_is_a_plugin_command_loaded_lazily():
    """The entry point adds `pagoda bench`; building the parser imports no benchmark module."""
    code = (
        "import sys; from server.cli import build_parser; "
        "p = build_parser(); assert 'bench' in p._subparsers._group_actions[0].choices; "
        "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "['bench', 'bench.cli']", out.stdout + out.stderr


def test_building_the_flags_loads_no_torch():
    """`pagoda --help` answers at once: the flags come from engine.config, which loads neither torch nor the
    model code."""
    code = "import sys; from server.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


@pytest.mark.parametrize("command", ["serve", "throughput"])
def test_pagoda_bench_help(command):
    pagoda = Path(sys.executable).with_name("pagoda")
    out = subprocess.run([str(pagoda), "bench", command, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: pagoda bench {command}")


def test_plots_without_matplotlib_name_the_extra(monkeypatch, tmp_path):
    from bench import latency, throughput

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec says: not installed
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[bench\]'"):
        throughput.main(["--plot-from", str(tmp_path / "absent.csv")])
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[bench\]'"):
        latency.main(["plot", str(tmp_path / "absent.json"), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[bench\]'"):
        latency.main(["--base-url", "http://127.0.0.1:9", "--plot", str(tmp_path / "x.png")])
