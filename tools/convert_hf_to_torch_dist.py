"""HF checkpoint -> Megatron torch_dist checkpoint, with upstream slime's command line:

    source scripts/models/qwen3-4B.sh
    python tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint /root/Qwen3-4B --save /root/Qwen3-4B_torch_dist
    torchrun --nproc-per-node 2 tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint ... --save ...

Writes SAVE/release/ and SAVE/latest_checkpointed_iteration.txt (`release`), tensors under upstream's names;
`--ref-load SAVE` / `--load SAVE` read it at any TP / PP / EP layout (slime.backends.megatron.checkpoint.convert).
"""

import os
import sys

# The checkout this script lives in, whatever the working directory (upstream runs it from the repo root).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.backends.megatron.checkpoint.convert import hf_to_torch_dist  # noqa: E402

if __name__ == "__main__":
    hf_to_torch_dist()
