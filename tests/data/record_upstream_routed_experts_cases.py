"""Records tests/data/upstream_routed_experts_cases.json: upstream slime's cp_utils.prepare_routed_experts_for_routing_replay
(slime/backends/megatron_utils/cp_utils.py) at each tensor- and context-parallel rank and size (megatron's mpu
replaced by a stand-in giving them), on routed experts of packed samples:
    git -C UPSTREAM show COMMIT:slime/backends/megatron_utils/cp_utils.py > /tmp/up_cp_utils.py
    python tests/data/record_upstream_routed_experts_cases.py /tmp/up_cp_utils.py COMMIT OUT.json
"""
import json
import sys
import types

import torch

up = types.ModuleType("up")
exec(compile(open(sys.argv[1]).read(), "up_cp_utils.py", "exec"), up.__dict__)
g = torch.Generator().manual_seed(3)
LENGTHS, LAYERS, TOPK, EXPERTS = (4, 7, 2), 2, 2, 5
experts = [torch.randint(0, EXPERTS, (n - 1, LAYERS, TOPK), generator=g, dtype=torch.int32) for n in LENGTHS]
tokens = [torch.arange(n) for n in LENGTHS]
cases = []
for tp in (1, 2):
    for cp in (1, 2, 3):
        for tp_rank in range(tp):
            for cp_rank in range(cp):
                up.mpu = types.SimpleNamespace(get_tensor_model_parallel_rank=lambda r=tp_rank: r,
                                               get_tensor_model_parallel_world_size=lambda s=tp: s,
                                               get_context_parallel_rank=lambda r=cp_rank: r,
                                               get_context_parallel_world_size=lambda s=cp: s)
                for multiplier in (1, 2):
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for allgather in (False, True):
                            out = up.prepare_routed_experts_for_routing_replay(
                                experts, tokens, num_experts=EXPERTS, data_pad_size_multiplier=multiplier,
                                sequence_parallel=sp, allgather_cp=allgather)
                            cases.append({"tp": [tp_rank, tp], "cp": [cp_rank, cp], "multiplier": multiplier,
                                          "sequence_parallel": sp, "allgather_cp": allgather, "out": out.tolist()})
json.dump({"repository": "THUDM/slime", "commit": sys.argv[2], "module": "slime/backends/megatron_utils/cp_utils.py",
           "function": "prepare_routed_experts_for_routing_replay", "num_experts": EXPERTS,
           "experts": [e.tolist() for e in experts], "lengths": list(LENGTHS), "cases": cases}, open(sys.argv[3], "w"))
print(len(cases))
