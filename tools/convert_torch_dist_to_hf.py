"""Megatron torch_dist checkpoint -> HF safetensors, with upstream slime's command line:

    python tools/convert_torch_dist_to_hf.py --input-dir /root/ckpt/iter_0000099 --output-dir /root/hf_out \
        --origin-hf-dir /root/Qwen3-4B [--vocab-size 151936] [-a] [-f]

Reads upstream's tensor names and this project's earlier ones (slime.backends.megatron.checkpoint.convert).
"""

import os
import sys

# The checkout this script lives in, whatever the working directory (upstream runs it from the repo root).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.backends.megatron.checkpoint.convert import torch_dist_to_hf  # noqa: E402

if __name__ == "__main__":
    torch_dist_to_hf()
