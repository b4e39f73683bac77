"""Worker of tests/test_pipeline_parallel.py: one RL training step of the trainer rank
(MegatronTrainRayActor, in-process, no Ray) per layout, ranks over gloo; rank 0 saves what the test
compares: per-token log-probs before and after the step, the step's metrics, and the updated weights of
every stage (full HF tensors). Optionally syncs the weights into an engine the test serves."""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

LR_ARGS = ["--lr", "0.1", "--adam-eps", "0.1"]  # eps > |grad|: the first Adam step is ~linear in the gradient


def batch(n: int = 8):
    """Samples of 4..15 tokens: the longer ones exceed index_topk = 8, so DSA drops keys."""
    from slime.backends.megatron.data import RolloutBatch

    rng = random.Random(3)
    seqs = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 15))] for _ in range(n)]
    resp = [rng.randint(1, len(s) - 2) for s in seqs]
    masks = [[int(rng.random() > 0.2) for _ in range(r)] for r in resp]
    for m in masks:
        m[0] = 1
    gen = torch.Generator().manual_seed(4)
    adv = [torch.randn(r, generator=gen) for r in resp]
    return RolloutBatch(tokens=seqs, response_lengths=resp, rewards=[0.0] * n, loss_masks=masks, advantages=adv)


def train_args(ckpt: str, world: int, layout: dict):
    from slime.config.arguments import parse_args

    flags = ["--hf-checkpoint", ckpt, "--num-rollout", "1", "--global-batch-size", "8", "--actor-num-gpus-per-node",
             str(world), "--use-dynamic-batch-size", "--max-tokens-per-gpu", "30", *LR_ARGS, "--clip-grad", "1.0",
             "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--entropy-coef", "0.01"]
    if layout.get("mtp"):
        flags += ["--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5"]
    for key, flag in (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
                      ("ep", "--expert-model-parallel-size"), ("first", "--decoder-first-pipeline-num-layers"),
                      ("last", "--decoder-last-pipeline-num-layers")):
        if key in layout:
            flags += [flag, str(layout[key])]
    return parse_args(flags)


def _merged(part_lists):
    out: dict[str, dict[int, torch.Tensor]] = {}
    for part in part_lists:
        for key, by_index in part.items():
            out.setdefault(key, {}).update(by_index)
    return out


def one_step(ckpt: str, world: int, rank: int, layout: dict):
    """(actor, result) of one step; result only on rank 0."""
    from slime.backends.megatron.actor import MegatronTrainRayActor

    ckpt = layout.get("ckpt", ckpt)
    args = train_args(ckpt, world, layout)
    actor = MegatronTrainRayActor(world, rank)
    actor.init(args, with_ref=True)
    b = batch()

    def log_probs():
        parts = [None] * world
        dist.all_gather_object(parts, actor.compute_log_probs(b)["log_probs"])  # last stage, TP rank 0 report
        return _merged(parts)

    before = log_probs()
    b.old_log_probs = [before["old_log_probs"][i] for i in range(len(b))]
    b.ref_log_probs = [before["ref_log_probs"][i] for i in range(len(b))]
    metrics = actor.train(0, b)
    after = log_probs()
    all_metrics = [None] * world
    dist.all_gather_object(all_metrics, metrics)
    result = {"before": before, "after": after, "metrics": all_metrics, "weights": all_weights(actor, world)}
    return actor, args, result


def all_weights(actor, world: int) -> dict[str, torch.Tensor]:
    """Every stage's exported HF tensors (each exactly once), on every rank."""
    from slime.backends.megatron import export_hf
    from slime.backends.megatron.hf_export import writer_of_stage

    weights = {}
    for bucket in export_hf(actor.model, 1 << 20):  # collective over the stage's TP / EP ranks
        if writer_of_stage():
            weights.update({n: t.detach().cpu().clone() for n, t in bucket})
    stage_weights = [None] * world
    dist.all_gather_object(stage_weights, weights)
    out: dict[str, torch.Tensor] = {}
    for w in stage_weights:
        assert not (out.keys() & w.keys()), "two stages exported the same tensor"
        out.update(w)
    return out


def checkpoint_roundtrip(actor, world: int, rank: int, out_dir: str) -> list[str]:
    """torch_dist save, the last stage's embedding copy zeroed, load: the exported tensors that did not come
    back (none: the copy is a replica of the first stage's embedding in the checkpoint, both stages read it)."""
    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.hf_export import unwrap

    before = all_weights(actor, world)
    root = os.path.join(out_dir, "ckpt_roundtrip")
    C.save(root, 0, actor.model, actor.optimizer, rank, actor._layout(), {})
    model = unwrap(actor.model)
    if model.holds_embedding_copy:
        with torch.no_grad():
            model.embedding.weight.zero_()
    C.load(root, actor.model, actor.optimizer, rank, actor._layout())
    after = all_weights(actor, world)
    return sorted(set(before) ^ set(after)) + [n for n in before if n in after and not torch.equal(after[n], before[n])]


def sync_to_engine(actor, args, rank: int, engine: dict) -> dict:
    """ipc, then distributed sync of the trained weights into the test's engine; then one sync in which stage 1
    sends a changed value must fail the checksum verification on rank 0."""
    from slime.backends.megatron.weight_sync import WeightSyncError, create_weight_sync

    out = {}
    for mode in ("ipc", "distributed"):
        args.update_weight_mode = mode
        args.colocate = True
        ws = create_weight_sync(args, actor.model, [engine], rank)
        ws.connect()
        m = ws.sync(1)
        out[mode] = m
        if mode == "distributed":
            send = ws.broadcast.send

            def corrupted(bucket, version, ws=ws, send=send):  # stage 1's transport flips a value after its checksum was taken
                if ws.role.stage == 1:
                    bucket = [(n, t + 1.0 if i == 0 else t) for i, (n, t) in enumerate(bucket)]
                send(bucket, version)

            ws.broadcast.send = corrupted
            try:
                ws.sync(2)
                out["corrupted"] = "no error"
            except WeightSyncError as e:
                out["corrupted"] = str(e)
            ws.broadcast.send = send
            ws.sync(3)  # restore the engine to the trained weights
        ws.close()
    return out


def trainer_side_step(actor, args, world: int) -> dict:
    """A second step through train_rollout (the production path): old/reference log-probs, advantages and
    training on each rank from the payload; reinforce++ with a KL reward term needs the old and reference
    log-probs on every pipeline stage. Returns the metrics every rank reports (train/ and the mismatch)."""
    from types import SimpleNamespace

    from slime.backends.megatron.rollout_data import pack_samples

    b = batch()
    gen = torch.Generator().manual_seed(9)
    samples = [SimpleNamespace(tokens=t, response_length=r, reward=float(torch.rand((), generator=gen)), loss_mask=m,
                               rollout_log_probs=(-torch.rand(r, generator=gen)).tolist())
               for t, r, m in zip(b.tokens, b.response_lengths, b.loss_masks)]
    args.advantage_estimator, args.kl_coef = "reinforce_plus_plus", 0.05
    metrics = actor.train_rollout(1, pack_samples(samples), False)
    everyone = [None] * world
    dist.all_gather_object(everyone, {k: v for k, v in metrics.items() if k.startswith("train")})
    return everyone


def run(rank: int, world: int, port: int, ckpt: str, layouts: list[dict], out_dir: str, engine: dict | None) -> None:
    try:
        _run(rank, world, port, ckpt, layouts, out_dir, engine)
    except BaseException:
        import traceback

        traceback.print_exc()  # the parent may be blocked serving an engine; the error must show here too
        raise


def _run(rank: int, world: int, port: int, ckpt: str, layouts: list[dict], out_dir: str, engine: dict | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if os.environ.get("PP_DEBUG"):
        import faulthandler
        faulthandler.dump_traceback_later(int(os.environ["PP_DEBUG"]), exit=True)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import warnings

    warnings.filterwarnings("ignore")
    for i, layout in enumerate(layouts):
        actor, args, result = one_step(ckpt, world, rank, layout)
        if engine is not None and i == 0:
            result["sync"] = sync_to_engine(actor, args, rank, engine)
        if layout.get("roundtrip"):
            result["roundtrip"] = checkpoint_roundtrip(actor, world, rank, out_dir)
        result["step2"] = trainer_side_step(actor, args, world)  # after a round trip: from the loaded optimizer
        if rank == 0:
            torch.save(result, os.path.join(out_dir, f"{layout['name']}.pt"))
        dist.barrier()
    dist.destroy_process_group()
