"""An offline word-level tokenizer for tiny test models and the synthetic RL task.

No hub access: the vocabulary is built here. Each character is a token (digits, letters,
a few symbols), plus a handful of instruction words, so prompts like "reverse: 3 1 4 =" tokenize
one symbol per token and rewards can be checked exactly.
"""

from __future__ import annotations

import json
import os
import string

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"]
WORDS = ["copy", "reverse", "sort", "count", "add", "answer", "is", "the"]
SYMBOLS = list(string.digits) + list(string.ascii_lowercase) + [":", "=", "+", "-", "?", ".", ",", "(", ")"]

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def base_vocab() -> list[str]:
    return SPECIAL_TOKENS + WORDS + SYMBOLS


def build_tokenizer(vocab_size: int = 512):
    """A transformers fast tokenizer; ids beyond the base vocabulary are `<extra_i>` placeholders."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = base_vocab()
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(tokens)} base tokens; use at least {len(tokens)}")
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # tokens are space-separated symbols
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    fast.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
        "{% elif m['role'] == 'assistant' %}<|assistant|> {{ m['content'] }} {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


def save_tokenizer(out_dir: str, vocab_size: int = 512) -> None:
    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer(vocab_size).save_pretrained(out_dir)


if __name__ == "__main__":  # pragma: no cover
    t = build_tokenizer()
    ids = t("reverse : 3 1 4 =")["input_ids"]
    print(ids, t.decode(ids), json.dumps(t.apply_chat_template([{"role": "user", "content": "copy : a b"}], tokenize=False, add_generation_prompt=True)))
