"""Upstream slime's plugin-facing types and helpers: Sample (append_response_tokens, to_dict/from_dict,
status from finish_reason), http_utils.post retries, remote_rm, the buffered data source, load_function."""

from __future__ import annotations

import asyncio
import json
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime.utils.types import Sample


def test_append_response_tokens_multi_turn():
    s = Sample(group_index=0, index=5, prompt="p", tokens=[1, 2, 3])
    s.append_response_tokens(None, tokens=[7, 8], log_probs=[-0.5, -0.25], trainable=True, text="ab",
                             meta_info={"finish_reason": {"type": "stop"}, "weight_version": "3",
                                        "cached_tokens": 2, "prompt_tokens": 3})
    s.append_response_tokens(None, tokens=[9, 9, 9], trainable=False, text=" tool")
    s.append_response_tokens(None, tokens=[4], log_probs=[-1.0], trainable=True, text="c",
                             meta_info={"finish_reason": {"type": "length"}, "weight_version": "4"})
    assert s.tokens == [1, 2, 3, 7, 8, 9, 9, 9, 4] and s.response == "ab toolc"
    assert s.response_length == 6 and s.prompt_length == 3 and s.prompt_tokens == [1, 2, 3]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1] and s.effective_response_length == 3
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert s.status == Sample.Status.TRUNCATED and s.weight_versions == ["3", "4"] and s.weight_version == "4"
    assert s.prefix_cache_info.prefix_cache_hit_rate == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="log_probs length 1 != tokens length 2"):
        s.append_response_tokens(None, tokens=[1, 2], log_probs=[0.0])
    with pytest.raises(ValueError, match="need the engine's log probabilities"):
        s.append_response_tokens(None, tokens=[1])
    with pytest.raises(ValueError, match="take no log probabilities"):
        s.append_response_tokens(None, tokens=[1], log_probs=[0.0], trainable=False)
    bare = Sample(tokens=[1], response_length=0)
    bare.tokens, bare.response_length = [1, 5], 1  # a response without log-probs cannot take trainable ones
    with pytest.raises(ValueError, match="have none"):
        bare.append_response_tokens(None, tokens=[6], log_probs=[-1.0])


def test_to_dict_from_dict_round_trip_and_reward_key():
    s = Sample(group_index=1, index=2, prompt="q", tokens=[1, 2], response="x", response_length=1, label="7",
               reward={"score": 1.0, "acc": True}, status=Sample.Status.COMPLETED, metadata={"k": 1})
    s.spec_info.add({"spec_accept_token_num": 3, "spec_draft_token_num": 4})
    d = json.loads(json.dumps(s.to_dict()))  # JSON-safe
    assert d["status"] == "completed" and d["spec_info"]["spec_accept_token_num"] == 3
    d["extra_field"] = "kept"
    back = Sample.from_dict(d)
    assert back.status is Sample.Status.COMPLETED and back.spec_info.spec_accept_rate == 0.75
    assert back.tokens == [1, 2] and back.reward == {"score": 1.0, "acc": True} and back.extra_field == "kept"
    assert back.get_reward_value(types.SimpleNamespace(reward_key="score")) == 1.0
    assert back.get_reward_value(types.SimpleNamespace(reward_key=None)) == {"score": 1.0, "acc": True}


class _Flaky(BaseHTTPRequestHandler):
    failures_left = 0
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Flaky.seen.append(body)
        if _Flaky.failures_left > 0:
            _Flaky.failures_left -= 1
            self.send_response(503)
            self.end_headers()
            return
        reply = json.dumps({"reward": len(body["response"]), "auth": self.headers.get("Authorization")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *a):
        pass


@pytest.fixture
def flaky_server(monkeypatch):
    from slime.utils import http_utils

    monkeypatch.setattr(http_utils, "RETRY_INTERVAL_S", 0.01)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Flaky.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_post_retries_then_answers_and_remote_rm(flaky_server):
    from slime.rollout import rm_hub
    from slime.utils.http_client import EngineError
    from slime.utils.http_utils import post

    _Flaky.failures_left = 2
    out = asyncio.run(post(flaky_server + "/rm", {"response": "abc"}, headers={"Authorization": "Bearer t"}))
    assert out == {"reward": 3, "auth": "Bearer t"} and len(_Flaky.seen) == 3
    _Flaky.failures_left = 5
    with pytest.raises(EngineError, match="503"):
        asyncio.run(post(flaky_server + "/rm", {"response": ""}, max_retries=2))
    _Flaky.failures_left = 0
    args = types.SimpleNamespace(custom_rm_path=None, rm_type="remote_rm", rm_url=flaky_server + "/rm")
    sample = Sample(group_index=0, index=0, prompt="p", response="hello", label="l")
    assert asyncio.run(rm_hub.async_rm(args, sample)) == {"reward": 5, "auth": None}
    assert _Flaky.seen[-1] == {"prompt": "p", "response": "hello", "label": "l"}


def test_buffered_data_source_serves_given_back_groups_first(tmp_path):
    from slime.rollout.data_source import DataSourceError, JsonlDataSource, RolloutDataSourceWithBuffer
    from slime.utils.tiny_tokenizer import build_tokenizer

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"copy : {c} =", "label": c}) + "\n" for c in "abcd"))
    tok = build_tokenizer()
    args = types.SimpleNamespace(n_samples_per_prompt=2, buffer_filter_path=None)
    ds = RolloutDataSourceWithBuffer(args, tok, JsonlDataSource(str(path), tok))
    first = ds.get_samples(2)
    assert [[s.index for s in g] for g in first] == [[0, 1], [2, 3]] and [g[0].label for g in first] == ["a", "b"]
    assert all(s.tokens and s.prompt_length == len(s.tokens) and s.status == Sample.Status.PENDING for g in first for s in g)
    ds.add_samples(first[1:])
    again = ds.get_samples(2)
    assert again[0] is first[1] and again[1][0].label == "c" and ds.get_buffer_length() == 0
    with pytest.raises(DataSourceError, match="groups of --n-samples-per-prompt"):
        ds.add_samples([first[0][:1]])


def test_load_function_errors_name_the_path():
    from slime.utils.misc import FunctionPathError, load_function

    assert load_function("slime.rollout.rm_hub.async_rm").__name__ == "async_rm"
    assert load_function("slime.rollout.rm_hub:batched_async_rm").__name__ == "batched_async_rm"
    for bad, needle in (("nodots", "must look like"), ("no_such_mod.fn", "cannot import"),
                        ("slime.rollout.rm_hub.nope", "no attribute 'nope'")):
        with pytest.raises(FunctionPathError, match=needle):
            load_function(bad)


def test_custom_config_path_sets_attributes(tmp_path, capsys):
    from slime.config.rollout_args import RolloutArgumentError, apply_custom_config, rollout_defaults

    cfg = tmp_path / "c.yaml"
    cfg.write_text("my_tool_url: http://127.0.0.1:1/x\nrollout_temperature: 0.5\n")
    args = rollout_defaults(custom_config_path=str(cfg))
    apply_custom_config(args)
    assert args.my_tool_url == "http://127.0.0.1:1/x" and args.rollout_temperature == 0.5
    cfg.write_text("- a\n- b\n")
    with pytest.raises(RolloutArgumentError, match="must hold a mapping"):
        apply_custom_config(args)
    args.custom_config_path = str(tmp_path / "missing.yaml")
    with pytest.raises(RolloutArgumentError, match="cannot be read"):
        apply_custom_config(args)


def test_plugin_request_limit_is_capped_by_max_concurrency_like_the_built_in_loop():
    from types import SimpleNamespace

    from slime.rollout.settings import request_concurrency
    from slime.utils import http_utils

    args = SimpleNamespace(max_concurrency=24, sglang_server_concurrency=512, rollout_num_engines=2)
    assert http_utils.request_limit(args) == 24 == request_concurrency(args, 2)
    small = SimpleNamespace(max_concurrency=64, sglang_server_concurrency=8, rollout_num_engines=3)
    assert http_utils.request_limit(small) == 24 == request_concurrency(small, 3)
    # A plugin's own namespace without the flags: 512 per engine, no overall cap (upstream's client).
    assert http_utils.request_limit(SimpleNamespace(rollout_num_engines=2)) == 1024
    http_utils.init_http_client(args)
    assert http_utils._state["concurrency"] == 24
    http_utils.init_http_client(SimpleNamespace(rollout_num_engines=1))
