"""Records tests/data/upstream_ppo_utils_cases.json: upstream slime's slime/utils/ppo_utils.py outputs on
seeded inputs.

Run against upstream's own file, outside this repository's code (the project never imports it):
    git -C UPSTREAM show COMMIT:slime/utils/ppo_utils.py > /tmp/up_ppo_utils.py
    python tests/data/record_upstream_ppo_utils_cases.py /tmp/up_ppo_utils.py COMMIT OUT.json
(torch.compile is switched off so the functions run eagerly on CPU; megatron-core must be importable).
tests/test_upstream_ppo_utils.py checks that slime.utils.ppo_utils gives the same outputs on every case.
"""
import json
import sys
import types
from argparse import Namespace

import torch

torch.compile = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
src = open(sys.argv[1]).read()
up = types.ModuleType("up"); exec(compile(src, "up_ppo_utils.py", "exec"), up.__dict__)
g = torch.Generator().manual_seed(38)
def rn(*s, scale=1.0): return torch.randn(*s, generator=g) * scale
def enc(x):
    if isinstance(x, torch.Tensor): return {"t": x.tolist(), "dtype": str(x.dtype).replace("torch.", "")}
    if isinstance(x, tuple): return {"tuple": [enc(v) for v in x]}
    if isinstance(x, list): return [enc(v) for v in x]
    if isinstance(x, Namespace): return {"namespace": vars(x)}
    return x
cases = []
def rec(fn, note, *args, **kw):
    out = getattr(up, fn)(*args, **kw)
    cases.append({"fn": fn, "note": note, "args": [enc(a) for a in args], "kwargs": {k: enc(v) for k, v in kw.items()}, "out": enc(out)})
for kt in ["k1", "k2", "k3", "low_var_kl"]:
    for T in (1, 7, 33):
        a, b = rn(T, scale=3.0), rn(T, scale=3.0)
        rec("compute_approx_kl", f"{kt} T={T}", a, b, kt)
        rec("compute_approx_kl", f"{kt} T={T} importance ratio", a, b, kt, importance_ratio=rn(T).exp() * 3)
for eps, hi, c in [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0), (0.2, 0.2, 1.5)]:
    for T in (1, 13, 40):
        rec("compute_policy_loss", f"eps={eps} high={hi} c={c} T={T}", rn(T, scale=0.5), rn(T), eps, hi, eps_clip_c=c)
for eps, hi in [(0.2, 0.2), (1.0, 4.0), (0.5, 0.1), (1.5, 0.28)]:
    for T in (1, 17):
        rec("compute_cispo_loss", f"eps={eps} high={hi} T={T}", rn(T, scale=0.7), -rn(T).abs(), rn(T), eps, hi)
for B, T in [(1, 1), (3, 11), (1, 131)]:
    for gamma, lambd in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)]:
        r, v = rn(B, T), rn(B, T)
        rec("vanilla_gae", f"B={B} T={T} gamma={gamma} lambd={lambd}", r, v, gamma, lambd)
        rec("chunked_gae", f"B={B} T={T} gamma={gamma} lambd={lambd}", r, v, gamma, lambd)
        rec("chunked_gae", f"B={B} T={T} gamma={gamma} lambd={lambd} chunk 4", r, v, gamma, lambd, chunk_size=4)
for B, T in [(1, 1), (2, 9), (1, 130)]:
    for d in (0.0, 0.9, 1.0):
        rec("chunked_discounted_returns", f"B={B} T={T} discount={d}", rn(B, T), d)
        rec("chunked_discounted_returns", f"B={B} T={T} discount={d} chunk 3", rn(B, T), d, chunk_size=3)
def masks(lengths):
    out = []
    for n in lengths:
        m = (torch.rand(n, generator=g) > 0.3).float(); m[0] = 1.0
        if n > 3: m[-1] = 0.0  # a tool / trailing span after the last trained token
        out.append(m)
    return out
for lengths in ([1], [5, 9, 3], [12, 30]):
    for kl_coef, gamma in [(0.0, 1.0), (0.05, 1.0), (0.1, 0.9)]:
        kl, m = [rn(n, scale=0.2) for n in lengths], masks(lengths)
        rw = rn(len(lengths))
        tot = [n + 4 for n in lengths]
        rec("get_reinforce_plus_plus_returns", f"lengths={lengths} kl_coef={kl_coef} gamma={gamma}", rw, kl, m, lengths, tot, kl_coef, gamma)
        rec("get_reinforce_plus_plus_baseline_advantages", f"lengths={lengths} kl_coef={kl_coef}", rw, kl, m, kl_coef)
        rec("get_grpo_returns", f"lengths={lengths}", rw, kl)
        lp, olp = [rn(n) for n in lengths], [rn(n) for n in lengths]
        rec("compute_gspo_kl", f"lengths={lengths}", lp, olp, lp, m)
        adv = [torch.full((n,), float(x)) for n, x in zip(lengths, rn(len(lengths)))]
        rec("compute_opsm_mask", f"lengths={lengths} delta=0.1", Namespace(opsm_delta=0.1), lp, olp, adv, m)
        v, r = [rn(n) for n in lengths], [rn(n) for n in lengths]
        rec("get_advantages_and_returns_batch", f"lengths={lengths} gamma={gamma}", tot, lengths, v, r, gamma, 0.95)
        rec("get_advantages_and_returns_batch", f"lengths={lengths} gamma={gamma} vanilla", tot, lengths, v, r, gamma, 0.95, chunked=False)
for T, V in [(1, 5), (6, 11), (9, 50)]:
    logits, tokens = rn(T, V, scale=2.0), torch.randint(0, V, (T,), generator=g)
    for we in (False, True):
        rec("calculate_log_probs_and_entropy", f"T={T} V={V} entropy={we}", logits, tokens, None, with_entropy=we)
        rec("calculate_log_probs_and_entropy", f"T={T} V={V} entropy={we} chunk 2", logits, tokens, None, with_entropy=we, chunk_size=2)
    keep = torch.rand(T, V, generator=g) > 0.5
    rec("calculate_log_probs_and_entropy", f"T={T} V={V} keep mask", logits, tokens, None, with_entropy=True, log_prob_keep_mask=keep)
rec("calculate_log_probs_and_entropy", "empty", torch.zeros(0, 7), torch.zeros(0, dtype=torch.long), None, with_entropy=True)
json.dump({"upstream": "THUDM/slime", "commit": sys.argv[2],
           "module": "slime/utils/ppo_utils.py",
           "how": "upstream's functions (torch.compile off) run on float32 inputs seeded with torch.Generator(38); tensors as nested lists with their dtype",
           "cases": cases}, open(sys.argv[3], "w"))
print(len(cases))
