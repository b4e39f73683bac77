"""Shared helpers of the GLM-5 model tests: tiny checkpoints, transformers references, grads by HF name."""

from __future__ import annotations

import random

import torch
from megatron_state import megatron_state_cleanup  # noqa: F401  (tests that clean up between their own steps import it from here)

# Larger than the writer's default init (0.02) so attention is far from uniform and DSA's token dropping
# changes the logits measurably.
INIT = dict(initializer_range=0.2)
VOCAB_LOW = 3  # token ids >= 3: the pad row (0) of transformers' embedding gets no gradient


def write_checkpoint(path, model_type: str, seed: int = 0, **overrides) -> str:
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(path), model_type=model_type, seed=seed, **(INIT | overrides))


def hf_model(path):
    from transformers import AutoModelForCausalLM

    from slime.accelerator import get_accelerator

    get_accelerator().apply_patches("transformers")  # DSA top-k tie rule of ops.lightning_indexer, as the engine runs it
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.train()  # dropout is 0; train mode as the trainer uses


def hf_grads_by_checkpoint_name(model) -> dict[str, torch.Tensor]:
    """transformers' in-memory grads under checkpoint names (fused experts split per expert)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), p.shape[1] // 2
            for e, g in enumerate(p.grad):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = g[:half], g[half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e, g in enumerate(p.grad):
                out[f"{prefix}.{e}.down_proj.weight"] = g
        else:
            out[name] = p.grad
    return out


def megatron_grads_by_hf_name(model, gather=None) -> dict[str, torch.Tensor]:
    """Our grads under HF names. `gather(tensor, kind)` returns the list of shards (TP/EP > 1)."""
    state = model.state_dict(keep_vars=True)
    out = {}
    for m in model.family.call("weight_maps", model):
        grad = getattr(state[m.param], "grad", None)
        if grad is None:
            continue
        shards = gather(grad, m.kind) if gather else [grad]
        out.update(zip(m.hf_names_after_gather(model.arch.n_routed_experts), m.to_hf(shards)))
    return out


def random_batch(batch: int, seq: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB_LOW, vocab, (batch, seq), generator=g)
    return ids, torch.arange(seq).expand(batch, seq).contiguous()


def add_mtp_layer(path, seed: int = 0) -> str:
    """Give a tiny checkpoint one MTP layer (model.layers.N.*): the last decoder layer's tensors
    perturbed, random enorm / hnorm / eh_proj / shared_head.norm, and the tied embed / head copies."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    path = str(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    config = json.load(open(os.path.join(path, "config.json")))
    n, h = config["num_hidden_layers"], config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    src = f"model.layers.{n - 1}."
    for name in [k for k in tensors if k.startswith(src)]:
        t = tensors[name]
        tensors[f"model.layers.{n}." + name[len(src):]] = t + 0.05 * torch.randn(t.shape, generator=g) * t.std().clamp(min=1e-3)
    mtp = f"model.layers.{n}."
    tensors[mtp + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "eh_proj.weight"] = 0.2 * torch.randn(h, 2 * h, generator=g)
    tensors[mtp + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    json.dump(config, open(os.path.join(path, "config.json"), "w"), indent=2)
    return path


def hf_mtp_reference(path, ids, pos):
    """MTP depth-1 logits built from transformers modules: the checkpoint's extra layer as a transformers
    decoder layer, fed eh_proj(cat(enorm(embed(ids shifted by 1)), hnorm(final hidden)))."""
    import copy
    import os

    from safetensors.torch import load_file

    model = hf_model(path).eval()
    cfg = copy.deepcopy(model.config)
    n = cfg.num_hidden_layers
    if getattr(cfg, "indexer_types", None):
        cfg.indexer_types = list(cfg.indexer_types) + ["full"]
    cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
    layer = type(model.model.layers[-1])(cfg, n).eval()
    tensors = load_file(os.path.join(str(path), "model.safetensors"))
    pre = f"model.layers.{n}."
    own = {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}
    experts = cfg.n_routed_experts
    state = {k: v for k, v in own.items() if ".experts." not in k}
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([own[f"mlp.experts.{e}.gate_proj.weight"], own[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(experts)])
    state["mlp.experts.down_proj"] = torch.stack([own[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)])
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
              "shared_head.head.weight"):
        state.pop(k)
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not unexpected and all("e_score" not in m for m in missing), (missing, unexpected)

    def rms(x, w, eps=cfg.rms_norm_eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    with torch.no_grad():
        hidden = model.model(ids, position_ids=pos).last_hidden_state
        shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        emb = model.model.embed_tokens(shifted)
        x = torch.nn.functional.linear(torch.cat([rms(emb, own["enorm.weight"]), rms(hidden, own["hnorm.weight"])], -1),
                                       own["eh_proj.weight"])
        seq = ids.shape[1]
        mask = torch.full((seq, seq), torch.finfo(x.dtype).min).triu(1)[None, None].expand(ids.shape[0], 1, seq, seq)
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))[0]
        return model.lm_head(rms(x, own["shared_head.norm.weight"]))


def rl_batch(n: int, seed: int, lengths: tuple[int, int], responses: tuple[int, int]) -> dict:
    """RolloutBatch fields of `n` random samples (token ids >= 3): lengths and response lengths drawn from the
    inclusive ranges; odd samples get positive advantages, even ones negative; rewards alternate 0 / 1."""
    rng = random.Random(seed)
    tokens, resp, masks, adv = [], [], [], []
    for i in range(n):
        length = rng.randint(*lengths)
        r = rng.randint(*responses)
        tokens.append([rng.randrange(VOCAB_LOW, 512) for _ in range(length)])
        resp.append(r)
        masks.append([1] + [int(rng.random() > 0.2) for _ in range(r - 1)])
        adv.append(torch.full((r,), 1.0 if i % 2 else -1.0) * (0.5 + rng.random()))
    return dict(tokens=tokens, response_lengths=resp, rewards=[float(i % 2) for i in range(n)], loss_masks=masks,
                advantages=adv, reuse_train_log_probs=True)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def spawn_ranks(run, world: int, *args) -> None:
    """Ranks 0..world-1 of `run(rank, world, port, *args)` (tests/rank_spawn.py), on a free rendezvous port."""
    from rank_spawn import spawn

    from slime.utils.net import free_port

    spawn(run, args=(world, free_port(), *args), nprocs=world, join=True)


def init_rank(rank: int, world: int, port: int) -> None:
    """A spawned trainer rank: one thread, no library warnings, the accelerator's process group on 127.0.0.1:port."""
    import os
    import warnings

    import torch.distributed as dist

    from slime.accelerator import get_accelerator

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group(get_accelerator().process_group_backend(), rank=rank, world_size=world)


def exported_weights(model) -> dict[str, torch.Tensor]:
    """Every HF tensor the trainer exports (a collective over the model's ranks), as CPU copies."""
    from slime.backends.megatron import model_setup

    return {n: t.detach().cpu().clone() for bucket in model_setup.export_hf(model, 1 << 20) for n, t in bucket}


def write_run_inputs(d, prompts: int, length: tuple[int, int], eval_prompts: int = 0) -> dict:
    """A quick-start run's inputs in folder `d`: the tiny GLM-5 checkpoint, `prompts` copy-task prompts
    (seed 0) of `length` (min, max) symbols and, with `eval_prompts`, an eval set (seed 1) of the same length."""
    import json

    from slime.rollout.synthetic import make_dataset
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    def jsonl(name: str, n: int, seed: int) -> str:
        path = d / name
        rows = make_dataset(n, seed=seed, min_len=length[0], max_len=length[1])
        path.write_text("".join(json.dumps(x) + "\n" for x in rows))
        return str(path)

    inputs = {"dir": d, "model": write_tiny_checkpoint(str(d / "model")), "data": jsonl("data.jsonl", prompts, 0)}
    if eval_prompts:
        inputs["eval_data"] = jsonl("eval.jsonl", eval_prompts, 1)
    return inputs
