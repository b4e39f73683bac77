"""slime.agent's deterministic pieces against upstream slime's on recorded cases (tests/data/upstream_agent_cases.json,
tests/data/record_upstream_agent_cases.py, upstream 624b824a8): model-output parsing, the adapters' wire
translation and sampling parameters, the trajectory manager's samples (tokens, response length, loss mask,
log-probs, metadata) over 60 random sessions with sub-agents, compactions, rewritten replays, re-tokenization
drift, fork thresholds and length caps, and the commands the harnesses and exec_and_wait send a sandbox.
Everything compared exactly (log-probs are copied, never computed)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import re

import pytest

from slime.agent import parsing, sandbox
from slime.agent import trajectory as traj
from slime.agent.adapters import AnthropicAdapter, BaseAdapter, OpenAIAdapter
from slime.agent.adapters import anthropic as anth
from slime.agent.adapters import common
from slime.agent.adapters import openai as oai
from slime.agent.harness import BaseHarness, ClaudeCodeHarness, CodexHarness, HarnessContext
from slime.utils.types import Sample

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_agent_cases.json")) as f:
    RECORD = json.load(f)
CASES = RECORD["cases"]


def _ids(group):
    return [c for c in CASES if c["group"] == group]


def _json(obj):
    """As the record stores it (tuples become lists)."""
    return json.loads(json.dumps(obj))


def strip_ids(obj):
    if isinstance(obj, dict):
        return {k: ("<id>" if k == "id" else strip_ids(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strip_ids(v) for v in obj]
    return obj


def test_record_names_upstream_and_covers_each_piece():
    assert RECORD["repository"] == "THUDM/slime" and RECORD["commit"].startswith("624b824a8")
    groups = {c["group"] for c in CASES}
    assert groups == {"parsing", "common", "openai", "anthropic", "trajectory", "sandbox", "harness"}
    assert len(_ids("trajectory")) >= 50


@pytest.mark.parametrize("c", _ids("parsing"), ids=lambda c: c["fn"])
def test_parsing(c):
    text, schema = c["args"]
    if c["fn"] == "parse_model_output":
        out = dataclasses.asdict(parsing.parse_model_output(text, tools_schema=schema, tool_parser_name=None,
                                                            reasoning_parser_name=None))
    elif c["fn"] == "parse_xml_tool_uses":
        out = parsing.parse_xml_tool_uses(text, schema)
    else:
        out = parsing.parse_tool_uses(text, schema, None)
    assert _json(out) == c["out"]


@pytest.mark.parametrize("c", _ids("common"), ids=lambda c: c["fn"])
def test_common(c):
    if c["fn"] == "_sampling_params":
        defaults, body, cls = c["args"]
        cls = {"OpenAIAdapter": OpenAIAdapter, "AnthropicAdapter": AnthropicAdapter}[cls]
        out = common._sampling_params(common.Session(sampling_defaults=dict(defaults)), dict(body),
                                      max_token_keys=cls.max_token_keys, stop_keys=cls.stop_keys)
    else:
        out = getattr(common, c["fn"])(*c["args"])
    assert _json(out) == c["out"]


@pytest.mark.parametrize("c", _ids("openai") + _ids("anthropic"), ids=lambda c: f"{c['group']}.{c['fn']}")
def test_wire_translation(c):
    mod = oai if c["group"] == "openai" else anth
    args = copy.deepcopy(c["args"])
    if c["fn"] == "_build_reply_parts":
        out = strip_ids(mod._build_reply_parts(parsing.ParsedModelOutput(**args[0]), args[1]))
    elif c["fn"] == "_fold_mid_list_system_into_user":
        out = [mod._fold_mid_list_system_into_user(args[0]), args[0]]
    else:
        out = getattr(mod, c["fn"])(*args)
    assert _json(out) == c["out"]


def _session(case):
    a = case["args"]
    mgr = traj.TrajectoryManager(fork_threshold_tokens=a["fork_threshold_tokens"])
    for call in a["calls"]:
        turn = traj.TurnRecord(prompt_ids=call["prompt_ids"], output_ids=call["output_ids"],
                               finish_reason=call["finish_reason"], output_log_probs=call["output_log_probs"],
                               ill_formed=call["ill_formed"])
        mgr.record_turn(call["sid"], turn=turn, prompt_messages=call["prompt_messages"],
                        response_message=call["response_message"], metadata={"sid": call["sid"]})
    samples = mgr.get_trajectory("s", base_sample=Sample(**a["base"]), reward=a["reward"],
                                 extra_metadata=a["extra_metadata"], max_sample_tokens=a["max_sample_tokens"])
    return mgr, samples


@pytest.mark.parametrize("c", _ids("trajectory"), ids=lambda c: f"seed{c['args']['base']['index']}")
def test_trajectory_samples(c):
    mgr, samples = _session(c)
    fields = ("index", "group_index", "rollout_id", "prompt", "label", "tokens", "response_length", "loss_mask",
              "rollout_log_probs", "reward", "metadata")
    got = [{k: getattr(s, k) for k in fields} | {"status": s.status.name} for s in samples]
    assert _json(got) == c["out"]["samples"]
    assert mgr.get_trajectory("s", base_sample=Sample()) == [] and c["out"]["second_call"] == 0
    assert mgr.turn_count("s") == c["out"]["turn_count_after"]


class RecordingSandbox:
    """Answers the marker poll with a given exit code; records every call as upstream's recording did."""

    sandbox_id = "rec"

    def __init__(self, exit_code=0):
        self.log, self.exit_code = [], exit_code

    async def exec(self, cmd, *, user="root", env=None, timeout=120, check=False, idempotent=True):
        self.log.append({"cmd": cmd, "user": user, "env": env, "timeout": timeout, "check": check,
                         "idempotent": idempotent})
        if re.search(r"test -f (\S+) && cat", cmd):
            return 0, f"{self.exit_code}\n", ""
        return (0, "tail of log", "") if cmd.startswith("tail -c") else (0, "", "")

    async def write_file(self, path, content, *, user="root"):
        self.log.append({"write": path, "content": content if isinstance(content, str) else str(content), "user": user})

    async def read_file(self, path, *, user="root"):
        self.log.append({"read": path, "user": user})
        return "whole output"


def _same_commands(got, want):
    """Equal, shell whitespace aside (two spaces and one separate the same words)."""
    norm = lambda log: _json([{k: re.sub(r" +", " ", v) if k == "cmd" else v for k, v in e.items()}  # noqa: E731
                              for e in log])
    assert norm(got) == norm(want)


@pytest.mark.parametrize("c", _ids("sandbox") + _ids("harness"), ids=lambda c: c["fn"])
def test_sandbox_commands(c, monkeypatch):
    monkeypatch.setattr(sandbox, "DONE_MARKER_POLL_SEC", 0.0)
    if c["fn"] == "exec_and_wait":
        sb = RecordingSandbox(c["args"][1])
        out = asyncio.run(sandbox.exec_and_wait(sb, **c["args"][0]))
        assert list(out) == c["out"]["result"]
        _same_commands(sb.log, c["out"]["log"])
    elif c["fn"] == "ensure_agent_user":
        sb = RecordingSandbox()
        asyncio.run(sandbox.ensure_agent_user(sb, *c["args"]))
        _same_commands(sb.log, c["out"])
    else:
        cls = {"ClaudeCodeHarness": ClaudeCodeHarness, "CodexHarness": CodexHarness}[c["fn"]]
        extra = c["args"][0]
        monkeypatch.delenv(cls.extra_args_env, raising=False)
        monkeypatch.delenv(cls.extra_envs_env, raising=False)
        if extra:
            monkeypatch.setenv(cls.extra_args_env, extra["ARGS"])
            monkeypatch.setenv(cls.extra_envs_env, extra["ENVS"])
        sb = RecordingSandbox()
        code = asyncio.run(cls().run(sb, workdir="/workspace/repo", session_id="sid-1", adapter_url="http://h:1",
                                     time_budget_sec=30, prompt="fix the bug's 'quote'"))
        assert code == c["out"]["exit"]
        _same_commands(sb.log, c["out"]["log"])


def test_package_faces_and_singletons():
    assert issubclass(OpenAIAdapter, BaseAdapter) and issubclass(AnthropicAdapter, BaseAdapter)
    assert ClaudeCodeHarness() is ClaudeCodeHarness() and CodexHarness() is not ClaudeCodeHarness()
    assert issubclass(CodexHarness, BaseHarness) and HarnessContext("/w", "s", "u").model_label == "slime-actor"
    assert isinstance(sandbox.LocalSandbox(), sandbox.Sandbox)  # the runtime-checkable protocol
    with pytest.raises(TypeError):
        BaseHarness()


def test_named_parser_without_sglang_is_refused_in_one_line():
    if parsing.sglang_parsers_available():
        pytest.skip("SGLang is installed: its parsers run")
    with pytest.raises(ValueError, match="--sglang-tool-call-parser qwen25: these are SGLang's parsers"):
        OpenAIAdapter(tokenizer=None, sglang_url="http://127.0.0.1:1", tool_parser="qwen25")


def _fake_e2b(monkeypatch, create_failures):
    """A stand-in `e2b` package (AsyncSandbox.create, commands.run, files, kill) with scripted failures."""
    import sys
    import types

    class ReadError(Exception):
        pass

    class CommandExitException(Exception):
        def __init__(self, exit_code, stdout, stderr):
            super().__init__("exit")
            self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr

    calls = {"create": [], "run": [], "killed": 0}

    class Commands:
        async def run(self, cmd, **kw):
            calls["run"].append(cmd)
            if cmd == "flaky":
                raise ReadError("severed")
            if cmd == "fail":
                raise CommandExitException(2, "o", "e")
            return types.SimpleNamespace(exit_code=0, stdout=cmd.upper(), stderr=None)

    class Files:
        async def read(self, path, user):
            raise ReadError("gone") if path == "missing" else None

    class AsyncSandbox:
        sandbox_id = "sbx-123456789"
        commands, files = Commands(), Files()

        @classmethod
        async def create(cls, timeout, metadata):
            calls["create"].append((timeout, metadata))
            if len(calls["create"]) <= create_failures:
                raise ReadError("connect")
            return cls()

        async def kill(self):
            calls["killed"] += 1

    e2b = types.ModuleType("e2b")
    e2b.AsyncSandbox = AsyncSandbox
    handle = types.ModuleType("e2b.sandbox.commands.command_handle")
    handle.CommandExitException = CommandExitException
    for name, mod in (("e2b", e2b), ("e2b.sandbox", types.ModuleType("e2b.sandbox")),
                      ("e2b.sandbox.commands", types.ModuleType("e2b.sandbox.commands")),
                      ("e2b.sandbox.commands.command_handle", handle)):
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def test_e2b_sandbox_retries_transient_failures_only(monkeypatch):
    for name in sandbox.E2BSandbox.image_metadata_key_env + sandbox.E2BSandbox.size_env:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY is not set"):
        asyncio.run(sandbox.E2BSandbox("img").__aenter__())
    monkeypatch.setenv("SWE_SANDBOX_IMAGE_METADATA_KEY", "gw.io/image")  # the legacy name is read too
    monkeypatch.setattr(sandbox.E2BSandbox, "rpc_backoff_base_sec", 0.0)
    calls = _fake_e2b(monkeypatch, create_failures=2)

    async def go():
        async with sandbox.E2BSandbox("img", timeout=60, rpc_retries=3) as sb:
            out = [sb.sandbox_id, await sb.exec("ls"), await sb.exec("fail"), await sb.read_file("missing")]
            with pytest.raises(RuntimeError, match=r"e2b exec failed \(exit=2\)"):
                await sb.exec("fail", check=True)
            with pytest.raises(Exception, match="severed"):
                await sb.exec("flaky", idempotent=False)
            runs = len(calls["run"])
            with pytest.raises(Exception, match="severed"):
                await sb.exec("flaky")
            return out, runs
    out, runs = asyncio.run(go())
    assert calls["create"] == [(60, {"gw.io/image": "img", "gw.io/size": "md"})] * 3  # two transient failures
    assert out == ["sbx-123456789", (0, "LS", ""), (2, "o", "e"), ""] and calls["killed"] == 1
    assert calls["run"].count("flaky") == 1 + 3 and runs == 4  # not retried when not idempotent; else 3 tries
