"""Records tests/data/upstream_tool_tail_cases.json: what upstream slime does with rollout routing replay for a
multi-turn sample whose last piece is a tool turn. Upstream's Sample.append_response_tokens (slime/utils/types.py,
with slime/utils/misc.py's decode_int32_meta_array) builds the sample (model turn, observation, model turn with
routed_experts_start_len, observation); its trainer's cp_utils.prepare_routed_experts_for_routing_replay is then
called with the sample's rows (megatron's mpu replaced by a stand-in for one rank) and its error is recorded:
    for f in utils/types.py utils/misc.py backends/megatron_utils/cp_utils.py; do
        git -C UPSTREAM show COMMIT:slime/$f > /tmp/up_$(basename $f); done
    python tests/data/record_upstream_tool_tail_cases.py /tmp COMMIT OUT.json
Run it in a process of its own: it puts upstream's modules in place of this project's `slime` package.
"""
import base64
import json
import os
import sys
import types

import torch


def _module(name, path=None, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    if path is not None:
        exec(compile(open(path).read(), path, "exec"), mod.__dict__)
    sys.modules[name] = mod
    return mod


src = sys.argv[1]
sys.modules.setdefault("pybase64", base64)
for name in ("slime", "slime.utils"):
    _module(name)
_module("slime.utils.http_utils", is_port_available=lambda *a, **k: True)
_module("slime.utils.misc", os.path.join(src, "up_misc.py"))
up_types = _module("slime.utils.types", os.path.join(src, "up_types.py"))
up_cp = _module("up_cp_utils", os.path.join(src, "up_cp_utils.py"))
up_cp.mpu = types.SimpleNamespace(get_tensor_model_parallel_rank=lambda: 0, get_tensor_model_parallel_world_size=lambda: 1,
                                  get_context_parallel_rank=lambda: 0, get_context_parallel_world_size=lambda: 1)

LAYERS, TOPK, EXPERTS = 2, 2, 8
args = types.SimpleNamespace(num_layers=LAYERS, moe_router_topk=TOPK)
engine = torch.randint(0, EXPERTS, (32, LAYERS, TOPK), generator=torch.Generator().manual_seed(0), dtype=torch.int32)


def wire(rows):
    return base64.b64encode(rows.contiguous().numpy().tobytes()).decode("ascii")


def model_turn(sample, response, start=0):
    fed = len(sample.tokens) + len(response) - 1
    meta = {"finish_reason": {"type": "stop"}, "routed_experts": wire(engine[start:fed]),
            "routed_experts_start_len": start}
    sample.append_response_tokens(args, tokens=response, log_probs=[-0.5] * len(response), meta_info=meta)


s = up_types.Sample(tokens=[1, 2, 3])
model_turn(s, [4, 5, 6])
s.append_response_tokens(args, tokens=[7, 8], trainable=False)
model_turn(s, [9, 10], start=4)
s.append_response_tokens(args, tokens=[11, 12, 13], trainable=False)
try:
    up_cp.prepare_routed_experts_for_routing_replay([torch.as_tensor(s.rollout_routed_experts)], [torch.tensor(s.tokens)],
                                                    num_experts=EXPERTS, data_pad_size_multiplier=1,
                                                    sequence_parallel=False, allgather_cp=False)
    refused = None
except Exception as e:  # noqa: BLE001 - whatever upstream raises is the record
    refused = {"type": type(e).__name__, "message": str(e)}
json.dump({"repository": "THUDM/slime", "commit": sys.argv[2],
           "modules": ["slime/utils/types.py", "slime/utils/misc.py", "slime/backends/megatron_utils/cp_utils.py"],
           "engine_routes": engine.tolist(), "tokens": s.tokens, "loss_mask": s.loss_mask,
           "rollout_log_probs": s.rollout_log_probs, "rollout_routed_experts": torch.as_tensor(
               s.rollout_routed_experts).tolist(), "trainer_refuses": refused}, open(sys.argv[3], "w"))
print(refused)
