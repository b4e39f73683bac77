"""Records tests/data/upstream_torch_dist_to_hf.json: what upstream slime's tools/convert_torch_dist_to_hf.py
writes from this project's torch_dist checkpoint of each tiny family (tensor name -> dtype, shape, sha256).

Run against upstream's own code, outside this repository (the project never imports it):
    python tests/data/record_torch_dist_interchange.py UPSTREAM_ROOT COMMIT [MODEL_TYPE ...]
(the given families only, merged into the existing record; all of them without) where UPSTREAM_ROOT holds upstream's slime/ and tools/ (e.g. `git archive COMMIT slime tools | tar -x`).
Each family's tiny random checkpoint (slime_plugins.models.common.tiny, seed 0) is converted with this
project's tools/convert_hf_to_torch_dist.py, then with upstream's converter in a subprocess whose
PYTHONPATH puts UPSTREAM_ROOT first. tests/test_checkpoint_interchange.py checks that this project's
converter writes the same tensors, bit for bit.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# GLM-5: upstream's converter hard-codes the indexer's head size (128) and rope size (64).
FAMILIES = {"qwen3": {}, "qwen3_moe": {}, "qwen2": {}, "llama": {}, "glm4_moe": {}, "glm4_moe_lite": {},
            "glm_moe_dsa": {"index_head_dim": 128, "qk_rope_head_dim": 64}, "glm4": {}, "deepseek_v3": {}, "minimax_m2": {},
            "qwen3_next": {}, "qwen3_5_text": {}, "qwen3_5_moe_text": {}, "qwen3_5": {}, "qwen3_5_moe": {}, "mimo": {}}
# MiMo as upstream's scripts/models/mimo-7B-rl.sh converts it (MODEL_ARGS with --mtp-num-layers 1: the MTP layer
# goes into torch_dist), at the tiny sizes; the HF side names the converter (transformers has no mimo config).
MIMO_MODEL_ARGS = ("--swiglu --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
                   "--group-query-attention --num-query-groups 2 --use-rotary-position-embeddings --disable-bias-linear "
                   "--add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 10000 --vocab-size 512 "
                   "--untie-embeddings-and-output-weights --max-position-embeddings 512 --mtp-num-layers 1").split()
# Extra command-line words per family: (convert_hf_to_torch_dist.py, convert_torch_dist_to_hf.py). Qwen3.5's
# vision-language checkpoints: the vision tower is not trained, -a copies it from --origin-hf-dir.
FLAGS = {"qwen3_5": ([], ["-a"]), "qwen3_5_moe": ([], ["-a"]), "mimo": (MIMO_MODEL_ARGS, ["--model-name", "mimo"])}


def write_tiny(out_dir: str, model_type: str, **overrides) -> str:
    """The family's tiny random checkpoint, seed 0 (MiMo: transformers has no type; its own writer)."""
    if model_type == "mimo":
        from slime_plugins.models.mimo.tiny import write_tiny_mimo_checkpoint

        return write_tiny_mimo_checkpoint(out_dir, seed=0, **overrides)
    from slime_plugins.models.common.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(out_dir, model_type, seed=0, **overrides)


def tensor_digest(path: str) -> dict[str, list]:
    from safetensors.torch import load_file

    out = {}
    for fn in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        for name, t in load_file(fn).items():
            out[name] = [str(t.dtype).removeprefix("torch."), list(t.shape),
                         hashlib.sha256(t.contiguous().view(-1).view(torch_uint8()).numpy().tobytes()).hexdigest()]
    return dict(sorted(out.items()))


def torch_uint8():
    import torch

    return torch.uint8


def main() -> None:
    upstream, commit, only = sys.argv[1], sys.argv[2], sys.argv[3:]
    path = os.path.join(HERE, "upstream_torch_dist_to_hf.json")
    record = {"upstream_commit": commit, "families": {}}
    if only:
        record = json.load(open(path))
        if record["upstream_commit"] != commit:
            raise SystemExit(f"{path} was recorded at {record['upstream_commit']}; record every family at {commit}")
    py = sys.executable
    for model_type, overrides in FAMILIES.items():
        if only and model_type not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            hf, td, out = (os.path.join(tmp, n) for n in ("hf", "torch_dist", "upstream_hf"))
            write_tiny(hf, model_type, **overrides)
            to_td, to_hf = FLAGS.get(model_type, ([], []))
            subprocess.run([py, os.path.join(REPO, "tools", "convert_hf_to_torch_dist.py"), *to_td, "--hf-checkpoint",
                            hf, "--save", td], check=True, cwd=REPO)
            env = dict(os.environ, PYTHONPATH=upstream)
            subprocess.run([py, os.path.join(upstream, "tools", "convert_torch_dist_to_hf.py"), "--input-dir",
                            os.path.join(td, "release"), "--output-dir", out, "--origin-hf-dir", hf, *to_hf],
                           check=True, cwd=tmp, env=env)
            record["families"][model_type] = {"overrides": overrides, "to_torch_dist_flags": to_td,
                                              "to_hf_flags": to_hf, "tensors": tensor_digest(out)}
            print(model_type, len(record["families"][model_type]["tensors"]), "tensors")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
