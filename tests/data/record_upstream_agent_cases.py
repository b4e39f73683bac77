"""Records tests/data/upstream_agent_cases.json from upstream slime's slime/agent (pure-python parts: model-output
parsing, the adapters' wire translation, the trajectory manager's samples, the harnesses' and exec_and_wait's
sandbox commands), run outside this repository's code:
    python tests/data/record_upstream_agent_cases.py UPSTREAM_GIT_DIR COMMIT OUT.json
Upstream's modules are loaded from `git show COMMIT:path`; its `slime.utils.types.Sample` and
`slime.utils.misc.SingletonMeta` are replaced by minimal stand-ins (torch-free), which is all those modules use
of them. tests/test_upstream_agent.py replays every case on this project's slime.agent.
"""

import asyncio
import copy
import dataclasses
import enum
import json
import os
import random
import re
import subprocess
import sys
import types

GIT, COMMIT, OUT = sys.argv[1:4]


def load(name: str, path: str) -> types.ModuleType:
    src = subprocess.run(["git", "-C", GIT, "show", f"{COMMIT}:{path}"], check=True, capture_output=True,
                         text=True).stdout
    mod = types.ModuleType(name)
    mod.__file__ = path
    sys.modules[name] = mod
    if name.count(".") and name.rsplit(".", 1)[0] in sys.modules:
        setattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], mod)
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def package(name: str) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = []
    sys.modules[name] = mod
    if "." in name:
        setattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], mod)


for p in ("slime", "slime.utils", "slime.agent", "slime.agent.adapters", "slime.agent.harness"):
    package(p)


@dataclasses.dataclass
class Sample:  # the fields upstream's trajectory sets
    class Status(enum.Enum):
        COMPLETED = "completed"
    index: int = None
    group_index: int = None
    rollout_id: int = None
    prompt: object = ""
    label: object = None
    tokens: list = dataclasses.field(default_factory=list)
    response_length: int = 0
    loss_mask: list = None
    rollout_log_probs: list = None
    reward: object = None
    status: object = None
    metadata: dict = dataclasses.field(default_factory=dict)
    response: str = ""


class SingletonMeta(type):
    _instances = {}

    def __call__(cls, *a, **k):
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*a, **k)
        return cls._instances[cls]


sys.modules["slime.utils.types"] = types.SimpleNamespace(Sample=Sample)
sys.modules["slime.utils.misc"] = types.SimpleNamespace(SingletonMeta=SingletonMeta)
parsing = load("slime.agent.parsing", "slime/agent/parsing.py")
traj = load("slime.agent.trajectory", "slime/agent/trajectory.py")
common = load("slime.agent.adapters.common", "slime/agent/adapters/common.py")
oai = load("slime.agent.adapters.openai", "slime/agent/adapters/openai.py")
anth = load("slime.agent.adapters.anthropic", "slime/agent/adapters/anthropic.py")
sandbox = load("slime.agent.sandbox", "slime/agent/sandbox.py")
hcommon = load("slime.agent.harness.common", "slime/agent/harness/common.py")
cc = load("slime.agent.harness.claude_code", "slime/agent/harness/claude_code.py")
codex = load("slime.agent.harness.codex", "slime/agent/harness/codex.py")
rnd = random.Random(11)
cases = []


def case(group, fn, args, out, **extra):
    cases.append({"group": group, "fn": fn, "args": args, "out": out, **extra})


# ---------------------------------------------------------------- parsing
TOOLS = [{"type": "function", "function": {"name": n, "description": "", "parameters": {}}}
         for n in ("bash", "read_file", "str_replace")]
TEXTS = [
    "", "plain answer", "  padded answer \n",
    "I will look.\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>",
    "<tool_call><function=read_file><parameter=path>a.py</parameter><parameter=start> 3 </parameter></function>"
    "</tool_call> and <tool_call><function=bash><parameter=command>pwd</parameter></function></tool_call> done",
    "<tool_call><function=unknown><parameter=x>1</parameter></function></tool_call>",
    "<tool_call><function=bash></function></tool_call>",
    "text <tool_call>\n<function=bash>\n<parameter=command>\necho '<a>'\n</parameter>\n</function>\n</tool_call>\ntail",
    "<tool_call><function=bash><parameter=command>x</parameter></function>",  # unclosed
    "thinking</think>answer <tool_call><function=str_replace><parameter=old>a\nb</parameter>"
    "<parameter=new></parameter></function></tool_call>",
    "<tool_call>{\"name\": \"bash\", \"arguments\": {\"command\": \"ls\"}}</tool_call>",
]
for text in TEXTS:
    for schema in (TOOLS, None, TOOLS[:1]):
        out = parsing.parse_model_output(text, tools_schema=schema, tool_parser_name=None, reasoning_parser_name=None)
        case("parsing", "parse_model_output", [text, schema], dataclasses.asdict(out))
        if schema:
            case("parsing", "parse_xml_tool_uses", [text, schema], list(parsing.parse_xml_tool_uses(text, schema)))
        case("parsing", "parse_tool_uses", [text, schema], list(parsing.parse_tool_uses(text, schema, None)))

# ---------------------------------------------------------------- adapters: wire translation
CONTENTS = [None, "s", 7, {"a": 1}, [], ["x", {"type": "text", "text": "t"}, {"type": "input_text", "text": "i"}],
            [{"type": "tool_result", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": ""}]},
             {"type": "image"}, {"type": "image_url", "image_url": "u"}, {"content": "c"}, {"text": None},
             {"text": 5}, {"type": "other"}, 3.5, {"type": "output_text", "text": "o"}]]
for c in CONTENTS:
    case("common", "flatten_content", [c], common.flatten_content(c))
for name, a in (("bash", {"b": 1, "a": 2}), ("x", None), ("y", {})):
    case("common", "tool_call_dict", [name, a], common.tool_call_dict(name, a))
for uses, fin in (([], "stop"), ([{"name": "x"}], "length"), ([], ""), ([], "length"), ([], None)):
    case("common", "manager_finish_reason", [uses, fin], common.manager_finish_reason(uses, fin))
for body in (None, {}, {"metadata": {"session_id": "s1"}, "user": "u"}, {"metadata": {"session_id": ""}, "user": "u"},
             {"metadata": "x", "user": 5}, {"user": ""}):
    case("common", "sid_from_body", [body], common.sid_from_body(body))
BODIES = [{}, {"max_tokens": 100}, {"max_tokens": 9000}, {"max_completion_tokens": 50, "max_tokens": 10},
          {"max_tokens": None, "max_output_tokens": 20, "stop": ["x"], "temperature": 0.5, "top_p": 0.9, "top_k": 5},
          {"stop_sequences": ["</s>"], "stop": "y", "max_tokens": 0}, {"stop": [], "temperature": None}]
for defaults in ({}, {"max_new_tokens": 64, "temperature": 1.0}, {"max_new_tokens": 64, "stop": ["q"]}):
    for body in BODIES:
        for cls in (oai.OpenAIAdapter, anth.AnthropicAdapter):
            sess = common.Session(sampling_defaults=dict(defaults))
            out = common._sampling_params(sess, dict(body), max_token_keys=cls.max_token_keys, stop_keys=cls.stop_keys)
            case("common", "_sampling_params", [defaults, body, cls.__name__], out)

OAI_MESSAGES = [
    [{"role": "developer", "content": "dev"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
     {"role": "assistant", "content": None, "reasoning_content": "why",
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"b\": 1, \"a\": [2]}"}},
                     {"id": "c2", "function": {"name": "read", "arguments": "not json"}}, "junk",
                     {"name": "flat", "arguments": {"k": "v"}}, {"function": {"arguments": "[1]"}},
                     {"function": {"name": "e", "arguments": "  "}}, {"function": {"name": "n", "arguments": 12}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "out"}, {"role": "function", "content": "dropped"}, "junk",
     {"role": "assistant", "content": [{"type": "text", "text": "done"}], "tool_calls": []}],
    [], [{"role": "system", "content": None}, {"role": "user"}],
]
for msgs in OAI_MESSAGES:
    case("openai", "_translate_messages", [msgs], oai._translate_messages(copy.deepcopy(msgs)))
OAI_TOOLS = [None, [], [{"type": "function", "function": {"name": "bash", "description": "d", "parameters": {"x": 1}}},
                        {"type": "web_search"}, {"name": "flat", "parameters": None}, {"function": {"description": "x"}},
                        {"type": "function", "function": "notdict", "name": "fb"}, "junk", {"type": "", "name": "e"}]]
for tools in OAI_TOOLS:
    case("openai", "_tools_to_chat_tools", [tools], oai._tools_to_chat_tools(copy.deepcopy(tools)))
PARSED = [dict(reasoning="", text="hello", tool_uses=[]), dict(reasoning="r", text="", tool_uses=[]),
          dict(reasoning="r", text="t", tool_uses=[{"name": "bash", "input": {"b": 2, "a": 1}},
                                                   {"name": "read", "input": {"p": "x"}}]),
          dict(reasoning="", text="t", tool_uses=[{"input": "raw"}]), dict(reasoning="", text="", tool_uses=[]),
          dict(reasoning="", text="x", tool_uses=[{"name": "n", "input": None}], ill_formed=True)]


def strip_ids(obj):
    if isinstance(obj, dict):
        return {k: ("<id>" if k == "id" else strip_ids(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strip_ids(v) for v in obj]
    return obj


for p in PARSED:
    for fin in ("stop", "length", "abort"):
        parsed = parsing.ParsedModelOutput(**p)
        case("openai", "_build_reply_parts", [p, fin], strip_ids(oai._build_reply_parts(parsed, fin)))
        if all("name" in u for u in p["tool_uses"]):
            case("anthropic", "_build_reply_parts", [p, fin], strip_ids(anth._build_reply_parts(parsed, fin)))
for a in ({"x": 1}, None, "", "  ", "{\"a\": 1}", "[1]", "nope", 3, ["l"]):
    case("openai", "_arguments_as_dict", [a], oai._arguments_as_dict(a))

ANTH = [
    ([{"role": "user", "content": "plain"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t1"}, {"type": "text", "text": "a"}, {"type": "thinking", "thinking": "t2"},
        {"type": "tool_use", "id": "tu1", "name": "bash", "input": {"c": 1}}, {"type": "text", "text": "b"},
        {"type": "tool_use", "id": "tu2", "input": None}, "junk"]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": [{"type": "text", "text": "r"}]},
                                   {"type": "text", "text": "next"}, {"type": "image"}, "s"]},
      {"role": "system", "content": [{"type": "text", "text": "mid"}]}, {"role": "other"}, 5,
      {"role": "assistant", "content": "str reply"}], [{"type": "text", "text": "sys"}]),
    ([], None), ([{"role": "user", "content": None}], "top"),
]
for msgs, system in ANTH:
    case("anthropic", "_translate_messages", [msgs, system], anth._translate_messages(copy.deepcopy(msgs), system))
for tools in (None, [], [{"name": "a", "input_schema": {"q": 1}}, {"name": "b", "parameters": {"p": 2}, "description": "d"},
                         {"description": "no name"}, "junk", {"name": "c"}]):
    case("anthropic", "_tools_to_chat_tools", [tools], anth._tools_to_chat_tools(copy.deepcopy(tools)))
FOLD = [
    {"messages": [{"role": "user", "content": "u1"}, {"role": "system", "content": "s1"},
                  {"role": "assistant", "content": "a"}, {"role": "system", "content": [{"type": "text", "text": "s2"}]}]},
    {"messages": [{"role": "system", "content": "first"}, {"role": "system", "content": "s"},
                  {"role": "user", "content": [{"type": "text", "text": "u"}]}]},
    {"messages": [{"role": "assistant", "content": "a"}, {"role": "system", "content": "alone"},
                  {"role": "system", "content": "again"}]},
    {"messages": [{"role": "user", "content": 3}, {"role": "system", "content": None}]},
    {"messages": []}, {"messages": "x"}, {},
    {"messages": [{"role": "system", "content": "only first"}, {"role": "user", "content": "u"}]},
]
for body in FOLD:
    b = copy.deepcopy(body)
    changed = anth._fold_mid_list_system_into_user(b)
    case("anthropic", "_fold_mid_list_system_into_user", [body], [changed, b])

# ---------------------------------------------------------------- trajectory manager
ROLE_ID = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
END, EOS = 5, 6


def words(text):
    return [100 + (sum(map(ord, w)) * 7 + len(w)) % 900 for w in text.split()]


def render(messages, gen=True):
    ids = []
    for m in messages:
        ids += [ROLE_ID[m["role"]], *words(m.get("content") or ""),
                *[11 for _ in m.get("tool_calls") or []], END]
    return ids + ([ROLE_ID["assistant"]] if gen else [])


def scenario(seed):
    """A session of turns: the client's history grows by the model's replies (sometimes replayed
    rewritten), tool results and user turns; sometimes a sub-agent (its own system prompt) or a
    compacted history starts over; outputs sometimes end with an EOS the template does not render."""
    r = random.Random(seed)
    vocab = "ls cat grep fix test ok yes no file line done run read edit".split()
    system = {"role": "system", "content": "you are an agent"}
    main = [system, {"role": "user", "content": "task " + r.choice(vocab)}]
    branches = {"main": main}
    calls = []
    for t in range(r.randint(1, 7)):
        name = "main" if r.random() < 0.75 or t == 0 else r.choice(["sub", "compact", "main"])
        if name not in branches:
            branches[name] = ([{"role": "system", "content": "sub agent"}, {"role": "user", "content": "subtask"}]
                              if name == "sub" else [system, {"role": "user", "content": "summary " + r.choice(vocab)}])
        hist = branches[name]
        text = " ".join(r.choice(vocab) for _ in range(r.randint(0, 6)))
        tool = r.random() < 0.5
        msg = {"role": "assistant", "content": "" if tool else text}
        if tool:
            msg["tool_calls"] = [{"type": "function", "function": {"name": "bash", "arguments": {"c": text}}}]
        out_ids = render([msg], gen=False)[1:-1]
        if r.random() < 0.3:
            out_ids = out_ids + [EOS]  # re-rendered history drops it: drift inside the last output
        prompt = render(hist)
        finish = r.choice(["stop", "stop", "length", "tool_calls"])
        logprobs = [round(-r.random(), 4) for _ in out_ids] if r.random() < 0.8 else []
        calls.append({"sid": "s", "prompt_ids": prompt, "output_ids": out_ids, "finish_reason": finish,
                      "output_log_probs": logprobs, "ill_formed": r.random() < 0.1,
                      "prompt_messages": copy.deepcopy(hist), "response_message": msg})
        replay = dict(msg, content=msg["content"] + " ") if r.random() < 0.15 else msg  # a client's rewrite
        hist = hist + [replay]
        hist.append({"role": "tool", "content": "out " + r.choice(vocab)} if tool
                    else {"role": "user", "content": r.choice(vocab)})
        branches[name] = hist
    return calls


def run_traj(calls, threshold, base, reward, max_tokens, extra):
    mgr = traj.TrajectoryManager(fork_threshold_tokens=threshold)
    for c in calls:
        turn = traj.TurnRecord(prompt_ids=c["prompt_ids"], output_ids=c["output_ids"], finish_reason=c["finish_reason"],
                               output_log_probs=c["output_log_probs"], ill_formed=c["ill_formed"])
        mgr.record_turn(c["sid"], turn=turn, prompt_messages=c["prompt_messages"],
                        response_message=c["response_message"], metadata={"sid": c["sid"]})
    samples = mgr.get_trajectory("s", base_sample=Sample(**base), reward=reward, extra_metadata=extra,
                                 max_sample_tokens=max_tokens)
    again = mgr.get_trajectory("s", base_sample=Sample(**base))
    fields = ("index", "group_index", "rollout_id", "prompt", "label", "tokens", "response_length", "loss_mask",
              "rollout_log_probs", "reward", "metadata")
    return {"samples": [{k: getattr(s, k) for k in fields} | {"status": s.status.name} for s in samples],
            "second_call": len(again), "turn_count_after": mgr.turn_count("s")}


for seed in range(60):
    calls = scenario(seed)
    threshold = [None, 0, 2, 4, 1024][seed % 5]
    base = {"index": seed, "group_index": seed // 4, "rollout_id": None if seed % 3 else 100 + seed,
            "prompt": f"p{seed}", "label": seed % 2}
    max_tokens = [0, 0, 0, 12, 40][seed % 5 if seed % 7 else 3]
    case("trajectory", "session", {"calls": calls, "fork_threshold_tokens": threshold, "base": base,
                                   "reward": seed / 10, "max_sample_tokens": max_tokens,
                                   "extra_metadata": {"k": seed} if seed % 2 else None},
         run_traj(calls, threshold, base, seed / 10, max_tokens, {"k": seed} if seed % 2 else None))


# ---------------------------------------------------------------- sandbox commands (harnesses, exec_and_wait)
class RecordingSandbox:
    sandbox_id = "rec"

    def __init__(self, exit_code=0):
        self.log, self.files, self.exit_code = [], {}, exit_code

    async def exec(self, cmd, *, user="root", env=None, timeout=120, check=False, idempotent=True):
        self.log.append({"cmd": cmd, "user": user, "env": env, "timeout": timeout, "check": check,
                         "idempotent": idempotent})
        m = re.search(r"test -f (\S+) && cat", cmd)
        if m:
            return 0, f"{self.exit_code}\n", ""
        if cmd.startswith("tail -c"):
            return 0, "tail of log", ""
        return 0, "", ""

    async def write_file(self, path, content, *, user="root"):
        self.log.append({"write": path, "content": content if isinstance(content, str) else str(content), "user": user})

    async def read_file(self, path, *, user="root"):
        self.log.append({"read": path, "user": user})
        return "whole output"


async def _no_sleep(_):
    return None


sandbox.asyncio = types.SimpleNamespace(sleep=_no_sleep)
for kw in ({"cmd": "make test", "time_budget_sec": 60, "tag": "t1"},
           {"cmd": "echo hi", "time_budget_sec": 60, "tag": "t2", "user": "agent", "env": {"A": "1"},
            "workdir": "/w", "out_file": "/w/out.log", "want_output": True}):
    for code in (0, 3):
        sb = RecordingSandbox(code)
        out = asyncio.run(sandbox.exec_and_wait(sb, **kw))
        case("sandbox", "exec_and_wait", [kw, code], {"result": list(out), "log": sb.log})
sb = RecordingSandbox()
asyncio.run(sandbox.ensure_agent_user(sb, "/workspace/repo"))
case("sandbox", "ensure_agent_user", ["/workspace/repo"], sb.log)
for cls in (cc.ClaudeCodeHarness, codex.CodexHarness):
    for extra in ({}, {"ARGS": "--max-turns 3", "ENVS": "{\"X\": \"y\", \"OPENAI_BASE_URL\": \"over\"}"}):
        os.environ.pop(cls.extra_args_env, None), os.environ.pop(cls.extra_envs_env, None)
        if extra:
            os.environ[cls.extra_args_env], os.environ[cls.extra_envs_env] = extra["ARGS"], extra["ENVS"]
        sb = RecordingSandbox()
        code = asyncio.run(cls().run(sb, workdir="/workspace/repo", session_id="sid-1", adapter_url="http://h:1",
                                     time_budget_sec=30, prompt="fix the bug's 'quote'"))
        case("harness", cls.__name__, [extra], {"exit": code, "log": sb.log})
        os.environ.pop(cls.extra_args_env, None), os.environ.pop(cls.extra_envs_env, None)

json.dump({"repository": "THUDM/slime", "commit": COMMIT, "module": "slime/agent",
           "recorded_with": "tests/data/record_upstream_agent_cases.py: upstream's modules run on these inputs, "
                            "outside this repository", "cases": cases}, open(OUT, "w"), indent=0, sort_keys=True)
print(len(cases), {g: sum(c["group"] == g for c in cases) for g in dict.fromkeys(c["group"] for c in cases)})
