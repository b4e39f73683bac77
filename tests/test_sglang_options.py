"""SGLang's option surface as --sglang-* flags: the record equals the installed SGLang 0.5.23 (its real msgspec
ServerArgs, imported in a subprocess by tests/sglang_surface_worker.py), upstream's command lines parse to the same
namespace with the live surface and with the record, values typed as SGLang types them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = json.loads((ROOT / "tests/data/upstream_train_commands.json").read_text())["scripts"]
BS = [1, 2, 4, 8] + list(range(16, 257, 8))  # `1 2 4 8 $(seq 16 8 256)` in upstream's scripts


def _argv(script: str, tmp_path: Path) -> list[str]:
    entry = COMMANDS[script]
    ckpt = tmp_path / script
    ckpt.mkdir()
    (ckpt / "config.json").write_text((ROOT / entry["config"]).read_text())
    argv = list(entry["argv"])
    argv[argv.index("--hf-checkpoint") + 1] = str(ckpt)
    return argv + ["--output-dir", str(tmp_path / "out"), "--dry-run"]


def _importable() -> bool:
    return all(importlib.util.find_spec(m) for m in ("sglang", "msgspec", "zmq"))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The installed SGLang's surface and parse_args of two upstream command lines with it (one subprocess)."""
    if not _importable():
        pytest.skip("SGLang 0.5.23 with msgspec/pyzmq not installed (scripts/setup-venv.sh installs them)")
    tmp = tmp_path_factory.mktemp("live")
    argvs = [_argv(s, tmp) for s in ("run-qwen3-4B.sh", "run-qwen3-30B-A3B.sh")]
    (tmp / "argv.json").write_text(json.dumps(argvs))
    r = subprocess.run([sys.executable, str(ROOT / "tests/sglang_surface_worker.py"), str(tmp / "argv.json"),
                        str(tmp / "out.json")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text()), argvs


def test_record_is_the_installed_sglang_surface(live):
    from slime.config.sglang_options import RECORD

    out, _ = live
    assert out["server_args_type"] == "StructMeta"  # 0.5.23's msgspec struct, not a dataclass
    record = json.loads(Path(RECORD).read_text())
    for package in ("sglang", "sglang-router"):
        assert out[package] == record[package], f"{package} changed: python tests/sglang_surface_worker.py --write-record"
    assert len(record["sglang"]["options"]) >= 500
    # SGLang's own value parsers and this project's stand-ins agree on samples
    for name, pairs in out["parsers"].items():
        assert all(theirs == ours for theirs, ours in pairs), name


def _plain(ns) -> dict:
    from tests.sglang_surface_worker import _plain as plain

    return {k: [type(v).__name__, plain(v)] for k, v in vars(ns).items() if k not in ("hf_config", "sglang_deployments")}


def test_upstream_command_lines_parse_alike_with_and_without_sglang(live):
    from slime.config.arguments import parse_args

    out, argvs = live
    for argv, with_sglang in zip(argvs, out["namespaces"]):
        without = _plain(parse_args(argv))
        assert without == with_sglang
    qwen4b, qwen30b = out["namespaces"]
    assert qwen4b["sglang_mem_fraction_static"] == ["float", 0.7]
    assert qwen30b["sglang_cuda_graph_bs_decode"] == ["list", BS]  # 0.5.7's --cuda-graph-bs, nargs + of int
    assert qwen30b["sglang_server_concurrency"] == ["int", 512]  # slime's own client-side limit
    assert qwen30b["router_balance_abs_threshold"] == ["int", 10]  # upstream slime's router default
    assert len([k for k in qwen30b if k.startswith("sglang_")]) >= 500


def test_list_switch_and_pair_options_parse_as_sglang_does(tmp_path):
    from slime.config.arguments import parse_args
    from slime.config.rollout_args import sglang_passthrough

    argv = _argv("run-qwen3-30B-A3B.sh", tmp_path)
    args = parse_args(argv + ["--sglang-enable-tf32-matmul", "--no-sglang-dcp-replicate-q-proj",
                              "--sglang-context-length", "4096", "--sglang-kv-cache-dtype", "fp8_e4m3",
                              "--sglang-ep", "4", "--router-policy", "round_robin"])
    assert args.sglang_cuda_graph_bs_decode == BS and args.sglang_cuda_graph_bs_prefill is None
    assert args.sglang_enable_tf32_matmul is True and args.sglang_dcp_replicate_q_proj is False
    assert args.sglang_ep_size == 4  # --ep is an SGLang alias of --ep-size
    cmd = sglang_passthrough(args)
    i = cmd.index("--cuda-graph-bs-decode")  # forwarded under SGLang 0.5.23's name
    assert cmd[i + 1:i + 1 + len(BS)] == [str(b) for b in BS]
    assert "--enable-tf32-matmul" in cmd and "--no-dcp-replicate-q-proj" in cmd
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and cmd[cmd.index("--ep-size") + 1] == "4"
    assert not any("concurrency" in t for t in cmd) and "--cuda-graph-bs" not in cmd
    from slime.config.sglang_options import router_option_tokens

    assert router_option_tokens(args) == ["--policy", "round_robin", "--balance-abs-threshold", "10",
                                          "--balance-rel-threshold", "1.2", "--log-level", "warn"]


@pytest.mark.parametrize("extra, needle", [
    (["--sglang-kv-cache-dtype", "fp7"], "invalid choice: 'fp7'"),
    (["--sglang-cuda-graph-bs", "1", "two"], "invalid int value: 'two'"),
    (["--sglang-no-such-option", "1"], "SGLang 0.5.23's ServerArgs has no option --no-such-option"),
    (["--sglang-nnodes", "2"], "slime sets SGLang's --nnodes itself"),
])
def test_bad_sglang_option_is_one_line(extra, needle, tmp_path, capsys):
    from slime.config.arguments import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(_argv("run-qwen3-4B.sh", tmp_path) + extra)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_server_concurrency_limits_requests_per_engine():
    from types import SimpleNamespace

    from slime.config.rollout_args import request_concurrency

    assert request_concurrency(SimpleNamespace(max_concurrency=64, sglang_server_concurrency=512), 2) == 64
    assert request_concurrency(SimpleNamespace(max_concurrency=64, sglang_server_concurrency=8), 2) == 16


def test_human_readable_int_as_sglang():
    import argparse

    from slime.config.sglang_options import _human_readable_int

    assert [_human_readable_int(v) for v in ("128k", "1.5M", "64Ki", "7")] == [128000, 1500000, 65536, 7]
    with pytest.raises(argparse.ArgumentTypeError):
        _human_readable_int("1.5Ki")


def test_the_real_router_takes_the_router_options(tmp_path):
    """sglang-router 0.3.2 starts with upstream's --router-* values (and a user's) appended to its command line."""
    from slime.config.arguments import parse_args
    from slime.config.sglang_options import router_option_tokens
    from slime.rollout.sglang_router import SGLangRouter, router_available
    from slime.utils.http_client import EngineClient
    from tests.test_sglang_router import _Worker

    if not router_available():
        pytest.skip("sglang-router not installed")
    args = parse_args(_argv("run-qwen3-4B.sh", tmp_path) + ["--router-policy", "random", "--router-max-payload-size",
                                                             "1048576"])
    extra = router_option_tokens(args) + ["--request-timeout-secs", str(args.sglang_router_request_timeout_secs)]
    assert extra[:4] == ["--policy", "random", "--balance-abs-threshold", "10"]
    worker = _Worker("a")
    router = SGLangRouter.start([worker.url], "127.0.0.1", str(tmp_path / "router.log"), timeout_s=120,
                                extra_args=extra)
    try:
        out = EngineClient(router.url, "token").generate([1, 2, 3], {"max_new_tokens": 1}, return_logprob=True)
        assert out["text"] == "a"
    finally:
        router.stop()


def test_nothing_is_forwarded_at_sglang_defaults():
    from slime.config.rollout_args import rollout_defaults, sglang_passthrough
    from slime.config.sglang_options import given_server_options

    args = rollout_defaults()
    assert given_server_options(args) == {} and sglang_passthrough(args) == []
