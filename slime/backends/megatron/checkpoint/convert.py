"""HF <-> torch_dist conversion with upstream slime's command lines (tools/convert_hf_to_torch_dist.py,
tools/convert_torch_dist_to_hf.py call `hf_to_torch_dist` / `torch_dist_to_hf`).

HF -> torch_dist: MODEL_ARGS (checked against config.json) + --hf-checkpoint + --save [+ parallel sizes],
under `torchrun` for several ranks (gloo on CPU); writes Megatron's release checkpoint (SAVE/release/ and
the tracker word `release`) with upstream's tensor names (checkpoint_keys), as upstream's tool does.
torch_dist -> HF: --input-dir (an iteration directory or a --save root) --output-dir --origin-hf-dir
[--vocab-size] [-a] [-f]: HF names, split of fused weights and vocabulary as upstream's converter writes them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger(__name__)


class ConversionError(ValueError):
    """Bad converter input; the message is one line naming the problem and the fix."""


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _world() -> tuple[int, int]:
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def hf_to_torch_dist_args(argv: list[str] | None = None) -> argparse.Namespace:
    from slime.backends.megatron.hf_io import HFCheckpoint, HFCheckpointError
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches, text_model_config

    parser = build_parser()
    parser.prog = "convert_hf_to_torch_dist.py"
    parser.add_argument("--custom-model-provider-path", default=None, help="upstream's flag; not supported here")
    parser.add_argument("--padded-vocab-size", type=int, default=None, help="upstream's flag; checked if given")
    args = parser.parse_args(argv)
    if not args.hf_checkpoint or not args.save:
        _fail("convert_hf_to_torch_dist.py needs --hf-checkpoint HF_DIR and --save OUT_DIR")
    if args.custom_model_provider_path:
        _fail("--custom-model-provider-path is not supported: the model comes from the registry of config.json's "
              "model_type; drop the flag")
    try:
        cfg = HFCheckpoint(args.hf_checkpoint).config
    except HFCheckpointError as e:
        _fail(str(e))
    bad = model_arg_mismatches(args, cfg)
    if bad:
        _fail(f"MODEL_ARGS disagree with {args.hf_checkpoint}/config.json: {'; '.join(bad)}")
    world, _ = _world()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    num_layers = int(text_model_config(cfg).get("num_hidden_layers", 0))  # Qwen3.5: under text_config
    # as upstream's tool: the ranks split the layers (else: replicas; with MTP layers too, which this project's
    # MTP block keeps on a single stage)
    if (num_layers and pp == 1 and tp == 1 and world > 1 and num_layers % world == 0
            and not cfg.get("tie_word_embeddings") and not args.mtp_num_layers):
        args.pipeline_model_parallel_size = world
    return args


def hf_to_torch_dist(argv: list[str] | None = None) -> str:
    """Returns the release directory written."""
    import torch
    import torch.distributed as dist

    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.hf_loader import load_hf_model
    from slime.backends.megatron.parallel import ensure_process_group

    args = hf_to_torch_dist_args(argv)
    if os.path.isdir(args.save) and os.listdir(args.save):
        _fail(f"--save {args.save} is not empty; pass a new directory (a converted checkpoint is never overwritten)")
    ensure_process_group()
    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else None)
    overrides = {}
    for flag, key in (("decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage"),
                      ("decoder_last_pipeline_num_layers", "num_layers_in_last_pipeline_stage")):
        if getattr(args, flag):
            overrides[key] = getattr(args, flag)
    # MODEL_ARGS with --mtp-num-layers (upstream's MiMo, GLM-5 scripts): the MTP layers go in, as upstream's tool
    # writes them
    model = load_hf_model(args.hf_checkpoint, args.tensor_model_parallel_size, args.expert_model_parallel_size,
                          args.pipeline_model_parallel_size, dtype=dtype, load_mtp=bool(args.mtp_num_layers),
                          **overrides)
    if args.padded_vocab_size is not None:
        from slime.backends.megatron.checkpoint.keys import padded_vocab_size

        want = padded_vocab_size(model.arch.vocab_size, args.make_vocab_size_divisible_by,
                                 args.tensor_model_parallel_size)
        if args.padded_vocab_size != want:
            _fail(f"--padded-vocab-size {args.padded_vocab_size}: the vocabulary {model.arch.vocab_size} pads to {want} "
                  "(--make-vocab-size-divisible-by x TP); drop the flag or change those")
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
              "ep": args.expert_model_parallel_size, "world_size": world}
    out = C.save(args.save, -1, model, None, rank, layout, {}, vocab_divisible_by=args.make_vocab_size_divisible_by)
    if rank == 0:
        print(f"{args.hf_checkpoint} -> {out} (torch_dist, upstream's names; {world} rank(s), tp={layout['tp']} "
              f"pp={layout['pp']} ep={layout['ep']})")
    return out


def torch_dist_to_hf_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="convert_torch_dist_to_hf.py",
                                description="A torch_dist checkpoint (upstream's or this project's names) to HF safetensors.")
    p.add_argument("--model-name", default=None, help="checked against --origin-hf-dir's config.json when given")
    p.add_argument("--input-dir", required=True, help="an iteration directory (iter_XXXXXXX, release) or a --save root")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--origin-hf-dir", default=None,
                   help="the HF checkpoint it came from: config.json (the architecture), tokenizer and other files")
    p.add_argument("-f", "--force", action="store_true", help="overwrite --output-dir if it exists")
    p.add_argument("-a", "--add-missing-from-origin-hf", action="store_true",
                   help="also write --origin-hf-dir tensors the torch_dist checkpoint lacks (e.g. MTP layers; a "
                        "never-trained vision tower, GLM-5.3-Flash's, is written back without it)")
    p.add_argument("--chunk-size", type=int, default=5 * 1024 ** 3, help="bytes per safetensors shard")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="rows of the embedding / output layer kept (Megatron's padding removed)")
    args = p.parse_args(argv)
    if args.origin_hf_dir is None:
        _fail("--origin-hf-dir is required here: its config.json gives the architecture (upstream also accepts "
              "--model-name alone); pass the HF checkpoint the torch_dist one came from")
    if os.path.exists(args.output_dir) and not args.force:
        _fail(f"--output-dir {args.output_dir} already exists; pass -f / --force to overwrite it")
    return args


def torch_dist_to_hf(argv: list[str] | None = None) -> str:
    import torch

    from slime.backends.megatron.checkpoint import torch_dist as C
    from slime.backends.megatron.checkpoint.layout import TORCH_DIST, CheckpointFormatError, find_checkpoint
    from slime.backends.megatron.hf_export import save_hf
    from slime.backends.megatron.hf_io import HFCheckpoint
    from slime.backends.megatron.hf_loader import load_hf_model
    from slime_plugins.models.common.weights import is_mtp_layer_name

    args = torch_dist_to_hf_args(argv)
    try:
        found = find_checkpoint(args.input_dir, "--input-dir")
    except CheckpointFormatError as e:
        _fail(str(e))
    if found.kind != TORCH_DIST:
        _fail(f"--input-dir {args.input_dir} holds no torch_dist checkpoint (an iteration directory with "
              "metadata.json, or a --save root with its tracker)")
    cfg = HFCheckpoint(args.origin_hf_dir).config
    if args.model_name and args.model_name.lower().replace("_", "").replace("-", "") not in (
            cfg.get("model_type", "").replace("_", ""), *[a.lower() for a in cfg.get("architectures", [])]):
        logger.warning("--model-name %s differs from %s's model_type %s; the config is used", args.model_name,
                       args.origin_hf_dir, cfg.get("model_type"))
    if args.vocab_size is not None and args.vocab_size != cfg.get("vocab_size"):
        _fail(f"--vocab-size {args.vocab_size} differs from {args.origin_hf_dir}/config.json's vocab_size "
              f"{cfg.get('vocab_size')}; pass that (the rows past it are Megatron's padding)")
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_tensors_metadata(found.path)
    dtype = _stored_dtype(saved)
    model = load_hf_model(args.origin_hf_dir, dtype=dtype, load_mtp=any(k.startswith("mtp.") for k in saved))
    origin = dict(model.passthrough_hf)
    # A vision tower the trainer never trains (GLM-5.3-Flash's) is in no torch_dist checkpoint: it always comes back
    # from the origin, so the converted checkpoint loads as the model it came from; -a adds the rest (MTP layers)
    model.passthrough_hf = {n: t for n, t in origin.items() if not is_mtp_layer_name(model.arch, n)}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # any weight the checkpoint does not set shows up, never the origin's
    C.load_model_weights(found.path, model, flag="--input-dir", metadata=saved)
    missing = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if missing:
        _fail(f"--input-dir {found.path} does not set {missing[:4]} ...; is it a checkpoint of this model?")
    if args.add_missing_from_origin_hf:
        model.passthrough_hf = origin
    out = save_hf(model, args.output_dir, max_shard_bytes=args.chunk_size)  # replaces an existing one when complete
    print(f"{found.path} -> {out} (HF safetensors, {len(saved)} torch_dist tensors read)")
    return out


def _stored_dtype(meta: dict):
    """The dtype of the checkpoint's embedding in its tensors' metadata (the model is built in it, so the
    export keeps it)."""
    for key in ("embedding.word_embeddings.weight", "embedding.weight"):
        if key in meta:
            return meta[key].dtype
    return None
