"""Records tests/data/upstream_cp_utils_cases.json: upstream slime's slime/backends/megatron_utils/cp_utils.py
outputs for each context-parallel rank and size (megatron's mpu replaced by a stand-in giving them):
    git -C UPSTREAM show COMMIT:slime/backends/megatron_utils/cp_utils.py > /tmp/up_cp_utils.py
    python tests/data/record_upstream_cp_utils_cases.py /tmp/up_cp_utils.py COMMIT OUT.json
tests/test_upstream_cp_utils.py checks slime.backends.megatron_utils.cp_utils against every case.
"""
import json
import sys
import types

import torch

up = types.ModuleType("up")
exec(compile(open(sys.argv[1]).read(), "up_cp_utils.py", "exec"), up.__dict__)
cases = []
g = torch.Generator().manual_seed(5)
for size in (1, 2, 3, 4):
    for rank in range(size):
        up.mpu = types.SimpleNamespace(get_context_parallel_rank=lambda r=rank: r,
                                       get_context_parallel_world_size=lambda s=size: s)
        base = {"cp_rank": rank, "cp_size": size}
        for total, response in ((10, 4), (17, 9), (5, 1), (33, 30), (9, 8), (40, 3)):
            if size > 1:
                out = up.get_logits_and_tokens_offset_with_cp(total, response)
                cases.append({**base, "fn": "get_logits_and_tokens_offset_with_cp", "total": total,
                              "response": response, "out": json.loads(json.dumps(out))})
            lp = torch.randn(response, generator=g)
            cases.append({**base, "fn": "slice_log_prob_with_cp", "total": total, "response": response,
                          "log_prob": lp.tolist(), "out": up.slice_log_prob_with_cp(lp, total, response).tolist(),
                          "out_list": up.slice_log_prob_with_cp(lp.tolist(), total, response)})
        for shape, pad in (((11,), 0), ((7, 3), -1.5), ((16,), 7)):
            t = torch.randn(*shape, generator=g)
            cases.append({**base, "fn": "slice_with_cp", "tokens": t.tolist(), "pad": pad,
                          "out": up.slice_with_cp(t, pad).tolist()})
        totals, responses = [10, 17, 40], [4, 9, 3]
        masks = [(torch.rand(n, generator=g) > 0.3).float() for n in responses]
        for per_token in (False, True):
            reducer = up.get_sum_of_sample_mean(totals, responses, masks, calculate_per_token_loss=per_token)
            local = sum(len(up.slice_log_prob_with_cp(torch.zeros(n), t, n)) for t, n in zip(totals, responses))
            x = torch.randn(local, generator=g)
            cases.append({**base, "fn": "get_sum_of_sample_mean", "totals": totals, "responses": responses,
                          "masks": [m.tolist() for m in masks], "per_token": per_token, "x": x.tolist(),
                          "out": float(reducer(x))})
json.dump({"repository": "THUDM/slime", "commit": sys.argv[2],
           "module": "slime/backends/megatron_utils/cp_utils.py", "cases": cases}, open(sys.argv[3], "w"))
print(len(cases))
