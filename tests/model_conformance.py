"""The model-family conformance suite's cases (tests/test_model_conformance.py), built from the model registry.

Every HF `model_type` a registered family serves is one case: its tiny checkpoint is written from the family's
`tiny_config` (slime_plugins/models/common/tiny.py), the reference is transformers' model of that checkpoint. A
new family joins by registering a tiny config; nothing here names it. What a family needs that the defaults do
not give (another reference class, longer sequences, a looser bound with the reason measured, layouts it cannot
run) is one entry in the tables below, each entry with its reason. A model_type without a tiny config and
without an entry in EXEMPT fails the suite (test_every_registered_model_type_is_a_case).

Checkpoints: seed 3, initializer_range 0.2 (attention far from uniform, routers far from ties), and every norm
weight, A_log and dt_bias perturbed by 0.3 * N(0, 1): a writer's init of ones (or of zeros for zero-centred
norms) would hide a norm applied the wrong way or a missing `1 +`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

VOCAB = 512  # every tiny config's vocabulary
SEED = 3
LAYOUTS = ("dp2", "tp2", "ep2", "cp2", "pp2")  # 2 ranks each; dp2 = tp = ep = 1, the torch_dist checkpoint's writer
CHECKS = ("logits", "export", "engine")  # the single-process tests (logits: with grads and packed sequences)


@dataclass(frozen=True)
class Case:
    name: str  # the test id: the model_type, or a variant's name
    family: str
    model_type: str
    overrides: dict = field(default_factory=dict)  # tiny-config overrides
    write: str = "tiny"  # "tiny": the family's tiny config; "mimo"; "renamed:<model_type>"; or a "module:function"
    # (case, path, **tiny-config overrides) -> path, e.g. from a family's test helpers
    reference_type: str | None = None  # the transformers model_type the reference runs as (None: the checkpoint's)
    reference: str | None = None  # "module:function" (case, path) -> transformers model, where AutoModelForCausalLM
    # cannot build the reference
    shapes: tuple = ((2, 5), (1, 17))  # (batch, length) of the logits / grads comparisons
    logits_tol: float = 1e-5  # max |ours - transformers| / max |transformers|
    grad_tol: float = 1e-5  # per tensor: max |ours - transformers| <= grad_tol * max |grad| + 1e-7
    grad_names: str = "checkpoint"  # transformers' grads -> checkpoint names: a key of GRAD_NAMES or "module:function"
    npu_sim: bool = True  # the logits test also on the Ascend path (the torch_npu simulator)
    npu_sim_logits_tol: float | None = None  # the logits bound there, where it differs from logits_tol (measured)
    checks: tuple = CHECKS  # the single-process tests it runs
    layouts: tuple = ()  # the multi-rank layouts (only the family's representative case has any)
    layout_overrides: dict = field(default_factory=dict)  # tiny-config overrides of the layouts' checkpoint
    # Checkpoints with an MTP layer that the trainer trains (--enable-mtp-training):
    mtp_reference: str | None = None  # "module:function" (case, path) -> float64 module: (ids) -> depth-1 MTP logits,
    # .grads() -> the grads of what was backpropagated through it (main model and MTP layer) under checkpoint names
    mtp_logits_tol: float = 5e-6  # float64, max |ours - reference| / max |reference|
    mtp_grad_tol: float = 5e-5  # float64, per tensor: max |ours - reference| <= tol * max |grad| + 1e-12
    mtp_layouts: tuple = ()  # 2-rank layouts (tp2 / ep2 / pp2 / cp2) whose losses and grads equal the single rank's


# Per-family differences from the defaults. Each is a fact about the family, measured, not a convenience.
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    # DSA keeps index_topk = 8 keys per query: lengths 19 and 13 make it drop keys (test_glm5_model.py checks it does).
    "glm5": dict(shapes=((2, 5), (1, 19), (2, 13))),
    # 70 tokens: two chunks of the chunked delta rule. Grads 1e-4 (measured up to 7e-5): every grad below a DeltaNet
    # layer comes back through float32 chunk products summed in another order than transformers' token loop.
    # On npu-sim the logits are 2.41e-5 of max |logit| off transformers' (cpu: 9.0e-6): all of it from the
    # DeltaNet's gated RMSNorm on the simulated npu_rms_norm, which computes in float64 and rounds once (0.5 ulp of
    # the float64 result; transformers' and the reference's float32 normalisation are 1 ulp off it). Those ulps,
    # amplified ~100x by two DeltaNet layers of the tiny checkpoint, are the gap: the same model with that one op
    # computed in float32 is 8.9e-6 off. No op is wrong; the bound there is the measured rounding. qwen3_5 (the same
    # DeltaNet code) stays on cpu: on npu-sim the same rounding puts its embedding grad 2.05e-4 of max off (bound
    # 1e-4), and qwen3_next's case already runs that code on the Ascend path.
    "qwen3_next": dict(shapes=((2, 70),), grad_tol=1e-4, npu_sim_logits_tol=5e-5),
    "qwen3_5": dict(shapes=((2, 70),), grad_tol=1e-4, npu_sim=False),
    # transformers ships no mimo type: the checkpoint is a Qwen2 plus MTP layers (slime_plugins/models/mimo/tiny.py),
    # its main model's reference is transformers' Qwen2 of the same tensors (the MTP layer: test_mimo_family.py).
    "mimo": dict(write="mimo", reference_type="qwen2"),
    # MiniMax-M2 checkpoints name experts Mixtral's way (block_sparse_moe.experts.{e}.w1 / w3 / w2).
    "minimax_m2": dict(grad_names="minimax_m2"),
    # GLM-5.3-Flash: DSA keeps index_topk = 8 keys per query (19 tokens drop keys); checkpoint names of the mHC,
    # KDA forget gate and causal convs are transformers' renames reversed (tests/glm5_next_helpers.py). The published
    # swiglu_limit (10; the tiny config's 0.15 clamps, and a value at the clamp edge flips its grad between the two
    # op orders). Grads 1e-4, as test_glm5_next_family.py (measured there up to 5.1e-5): the mHC base / scale grads
    # sum over every token and stream.
    "glm5_next": dict(shapes=((2, 5), (1, 19)), grad_names="glm5_next", overrides=dict(swiglu_limit=10.0),
                      grad_tol=1e-4),
}

MODEL_TYPE_TRAITS: dict[str, dict[str, Any]] = {
    # Kimi-K2 ships model_type kimi_k2, which transformers lacks: a deepseek_v3 checkpoint under that name, run by
    # transformers (and by the embedded engine) as DeepseekV3ForCausalLM. Its model is deepseek_v3's (logits bit for
    # bit: test_model_families.py), so logits / grads and packed sequences are the deepseek_v3 case's; what the name
    # changes is the round trip (config.json keeps kimi_k2) and the engine's choice of class.
    "kimi_k2": dict(write="renamed:deepseek_v3", reference_type="deepseek_v3", checks=("export", "engine")),
    # The dense Qwen3.5 vision-language checkpoint: its text model is qwen3_5_text's, and the vision-language wrapper
    # (text model under model.language_model., vision tower passed through) is the same code as qwen3_5_moe's, whose
    # case runs the logits / grads; what this one adds is its own round trip and engine.
    "qwen3_5": dict(checks=("export", "engine")),
}


def _variants() -> list[Case]:
    """Published shapes a family serves through overrides of its tiny config (ids of their own)."""
    from slime_plugins.models.deepseek_v3.tiny import MOONLIGHT

    # Moonlight-16B-A3B: no q LoRA, 2 shared experts, plain rotary, one expert group.
    # GLM-5.3-Flash with its MTP layer (layer N, no hc_*; tests/glm5_next_mtp_reference.py): the MTP logits, loss and
    # grads against transformers' modules in float64 (not to the last bit: transformers' RMSNorms and router compute
    # in float32 inside a float64 model, and the mHC parameters stay float32, as transformers keeps them), the
    # layouts against the single rank; the round trip keeps the MTP layer. Logits / grads / engine: the glm5_next case.
    glm5_next_mtp = Case(name="glm5_next_mtp", family="glm5_next", model_type="glm5_next", checks=("export",),
                         write="glm5_next_mtp_reference:write_mtp_checkpoint", overrides=dict(swiglu_limit=10.0),
                         mtp_reference="glm5_next_mtp_reference:mtp_reference", mtp_layouts=("tp2", "ep2", "pp2", "cp2"))
    return [Case(name="moonlight", family="deepseek_v3", model_type="deepseek_v3", overrides=MOONLIGHT), glm5_next_mtp]


# model_type -> why it has no case. A registered model_type that is neither a case nor here fails the suite.
EXEMPT: dict[str, str] = {}

# Multi-rank layouts per family: (the model_type that runs them, its layouts, checkpoint overrides). A family not
# listed runs every layout of LAYOUTS on its first model_type (ep2 only where it has routed experts). A tied
# checkpoint asked for pp2 must fail with one clear error (the worker checks that instead of running it).
FAMILY_LAYOUTS: dict[str, tuple[str, tuple[str, ...], dict]] = {
    "qwen3": ("qwen3", ("dp2", "tp2", "cp2", "pp2"), {}),  # tied embeddings: pp2 is the one-line error
    "llama": ("llama", ("pp2",), {"num_hidden_layers": 4}),  # two layers per stage
    "glm4": ("glm4", ("dp2", "tp2", "cp2"), {}),
    "glm4_moe": ("glm4_moe", ("dp2", "tp2", "ep2", "cp2"), {}),
    "deepseek_v3": ("deepseek_v3", ("dp2", "tp2", "ep2", "cp2"), {}),
    "qwen3_next": ("qwen3_next", ("tp2", "ep2", "cp2"), {}),
    "qwen3_5": ("qwen3_5_text", ("tp2", "cp2", "pp2"), {}),
    "mimo": ("mimo", ("dp2", "tp2", "cp2"), {}),  # MTP logits at every tp / ep layout too
    "minimax_m2": ("minimax_m2", ("dp2", "tp2", "ep2", "cp2", "pp2"), {}),
    # The same GQA model (common/gqa_model.py) as qwen3 / glm4_moe, which run its layouts: q/k/v bias (qwen2)
    # and softmax routing without a shared expert (qwen3_moe) change no sharding.
    "qwen2": ("qwen2", (), {}),
    "qwen3_moe": ("qwen3_moe", (), {}),
    # tests/test_glm5_parallel.py: tp2, ep2 and pp2 with an MTP layer, on cpu and npu-sim, an idle expert rank.
    "glm5": ("glm_moe_dsa", (), {}),
    # tests/test_glm5_next_family.py: tp2, ep2, pp2 (streams across the boundary), cp2, the torch_dist round trip.
    "glm5_next": ("glm5_next", (), {}),
}


def cases() -> list[Case]:
    """One case per registered model_type not in EXEMPT, in registry order, then the variants."""
    from slime_plugins.models.registry import families

    out = []
    for family in families():
        name, layouts, layout_overrides = FAMILY_LAYOUTS.get(family.name, (family.model_types[0], None, {}))
        for model_type in family.model_types:
            if model_type in EXEMPT:
                continue
            traits = FAMILY_TRAITS.get(family.name, {}) | MODEL_TYPE_TRAITS.get(model_type, {})
            if model_type == name:
                traits |= dict(layouts=LAYOUTS if layouts is None else layouts, layout_overrides=layout_overrides)
            out.append(Case(name=model_type, family=family.name, model_type=model_type, **traits))
    return out + _variants()


# ---- checkpoints ----


def _perturb(path: str) -> str:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    state, g = load_file(file), torch.Generator().manual_seed(SEED)
    for name, t in state.items():
        if name.endswith(("norm.weight", "A_log", "dt_bias")):
            state[name] = t + 0.3 * torch.randn(t.shape, generator=g, dtype=t.dtype)
    save_file(state, file, metadata={"format": "pt"})
    return path


def write_checkpoint(case: Case, path: str, **overrides) -> str:
    """The case's tiny checkpoint at `path` (overrides on top of the case's)."""
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    kwargs = dict(seed=SEED, initializer_range=0.2) | case.overrides | overrides
    if case.write == "tiny":
        return _perturb(write_tiny_checkpoint(path, case.model_type, **kwargs))
    if case.write == "mimo":
        from slime_plugins.models.mimo.tiny import write_tiny_mimo_checkpoint

        return _perturb(write_tiny_mimo_checkpoint(path, **kwargs))
    if case.write.startswith("renamed:"):
        _perturb(write_tiny_checkpoint(path, case.write.removeprefix("renamed:"), **kwargs))
        config_file = os.path.join(path, "config.json")
        config = json.load(open(config_file))
        json.dump(config | {"model_type": case.model_type}, open(config_file, "w"), indent=2)
        return path
    return resolve_hook(case.write)(case, path, **kwargs)


def resolve_hook(path: str) -> Callable:
    """A "module:function" hook of the tables above (a family's test helpers)."""
    import importlib

    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"a hook is 'module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


# ---- references ----


def reference_model(case: Case, path):
    """transformers' model of the checkpoint (float32, train mode: dropout is 0, as the trainer runs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime.accelerator import get_accelerator

    get_accelerator().apply_patches("transformers")  # DSA top-k tie rule of ops.lightning_indexer, as the engine runs it
    if case.reference:
        return resolve_hook(case.reference)(case, path)
    config = None
    if case.reference_type:
        raw = json.load(open(os.path.join(str(path), "config.json")))
        config = AutoConfig.for_model(case.reference_type, **{k: v for k, v in raw.items() if k != "model_type"})
    from slime_plugins.models.common.hf_classes import causal_lm_class

    # GLM-5.3-Flash: a class AutoModelForCausalLM lacks (the multimodal one, or the project's text-only head)
    model_class = causal_lm_class(json.load(open(os.path.join(str(path), "config.json")))["model_type"])
    return (model_class or AutoModelForCausalLM).from_pretrained(str(path), config=config, dtype=torch.float32).train()


def _minimax_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    out = {}
    for name, g in grads.items():
        name = re.sub(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.",
                      lambda m: f".experts.{m.group(1)}.{names[m.group(2)]}.", name)
        out[name.replace(".mlp.", ".block_sparse_moe.")] = g
    return out


def _glm5_next_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from glm5_next_helpers import on_disk_names

    return on_disk_names(grads)


GRAD_NAMES: dict[str, Callable[[dict], dict]] = {"checkpoint": lambda grads: grads, "minimax_m2": _minimax_names,
                                                 "glm5_next": _glm5_next_names}


def reference_grads(case: Case, model, hf_prefix: str = "model") -> dict[str, torch.Tensor]:
    """transformers' grads under the checkpoint's names. `hf_prefix`: where the checkpoint keeps the text model
    (a vision-language checkpoint's model.language_model; transformers' CausalLM of it names it model)."""
    from glm5_helpers import hf_grads_by_checkpoint_name

    rename = GRAD_NAMES[case.grad_names] if case.grad_names in GRAD_NAMES else resolve_hook(case.grad_names)
    grads = rename(hf_grads_by_checkpoint_name(model))
    if hf_prefix == "model":
        return grads
    # a reference that is the multimodal class itself (GLM-5.3-Flash) names the text model by the prefix already
    return {(hf_prefix + name[len("model"):] if name.startswith("model.") and not name.startswith(hf_prefix + ".")
             else name): g for name, g in grads.items()}


MTP_SCALE = 0.3  # --mtp-loss-scaling-factor of the MTP checks


def main_and_mtp_losses(logits: torch.Tensor, mtp: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main loss, MTP loss) of [B, S, V] logits and depth-1 MTP logits: each the per-sample mean cross entropy of
    its targets (token t + 1 for the main logits, t + 2 for depth 1) over the rows that have one, summed over the
    samples and divided by their number; both reduced by the trainer's mtp_loss (the MTP one times MTP_SCALE)."""
    from slime.accelerator import get_accelerator
    from slime.backends.megatron.loss import mtp_loss

    batch, seq = ids.shape

    def loss(x: torch.Tensor, k: int, scale: float) -> torch.Tensor:
        targets = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], 1).reshape(-1)
        lp, _ = get_accelerator().ops.token_log_probs(x.reshape(batch * seq, -1), targets)
        mask = torch.ones(batch, seq, dtype=lp.dtype)
        mask[:, seq - k:] = 0  # rows t >= S - k have no token t + k
        return mtp_loss([lp], [mask.reshape(-1)], [seq] * batch, normalizer=float(batch), scale=scale,
                        per_token=False)[0]

    return loss(logits, 1, 1.0), loss(mtp, 2, MTP_SCALE)


def rel_max(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return float((ours.detach() - ref.detach()).abs().max() / ref.detach().abs().max().clamp(min=1e-30))


def assert_grads_match(ours: dict, theirs: dict, tol: float, where: str = "") -> None:
    assert ours.keys() == theirs.keys(), (where, sorted(ours.keys() ^ theirs.keys())[:5])
    for name, g in theirs.items():
        err = float((ours[name].cpu() - g).abs().max())
        assert err <= tol * float(g.abs().max()) + 1e-7, (where, name, err, float(g.abs().max()))


def trainer_logprobs(model, prompts, responses) -> list[torch.Tensor]:
    """Teacher-forced log-probs of each response, all sequences in one packed (THD) forward."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from slime.accelerator import get_accelerator

    seqs = [p + r for p, r in zip(prompts, responses)]
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    longest = max(len(s) for s in seqs)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    ids = torch.tensor([t for s in seqs for t in s])[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        logits = model(ids, pos, packed_seq_params=packed)[0]
    return [get_accelerator().ops.token_log_probs(logits[s + len(p) - 1: s + len(p) + len(r) - 1], torch.tensor(r))[0]
            .float() for s, p, r in zip(cu.tolist(), prompts, responses)]
