"""The embedded engine's text requests that continue a text it returned (slime/backends/embedded/text_continuations.py):
an upstream-style multi-turn generate that posts `prompt + response so far` as text and trains on the returned ids
plus each observation tokenized alone gets log-probs conditioned on exactly those ids.
The whole-run check is tests/test_plugins.py (tiny model) and tests/test_smollm2_plugins.py (SmolLM2)."""

from __future__ import annotations

import random

import pytest
import torch

from slime.backends.embedded.text_continuations import TextContinuations


class _Words:
    """A word-level tokenizer with a BOS it adds to prompts: ids are word positions in a growing vocabulary."""

    def __init__(self):
        self.vocab = {"<bos>": 0}

    def __call__(self, text, add_special_tokens=True):
        ids = [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]
        return {"input_ids": ([0] if add_special_tokens else []) + ids}


def test_longest_remembered_prefix_then_the_rest_alone():
    tok, memo = _Words(), TextContinuations()
    assert memo.tokenize("a b", tok) == [1, 2]  # nothing remembered: a prompt, no special tokens added
    memo.remember("a b", [0, 7])
    memo.remember("a bc d", [0, 7, 8, 9])
    assert memo.tokenize("a bc d.e f", tok) == [0, 7, 8, 9] + tok(".e f", add_special_tokens=False)["input_ids"]
    assert memo.tokenize("a b x", tok) == [0, 7, tok("x")["input_ids"][1]]  # the shorter one where the longer fails
    assert memo.tokenize("a bc d", tok) == [0, 7, 8, 9]  # the text itself: its ids, nothing added
    assert memo.tokenize("z a b", tok) == tok("z a b", add_special_tokens=False)["input_ids"]  # not a prefix


def test_oldest_entries_leave_first():
    tok, memo = _Words(), TextContinuations(capacity=2)
    for i, text in enumerate(["p", "q", "r"]):
        memo.remember(text, [100 + i])
    assert memo.longest_prefix("p tail") is None
    assert memo.longest_prefix("q tail") == ("q", [101]) and memo.tokenize("r", tok) == [102]
    memo.remember("", [5])  # an empty text continues everything: never remembered
    assert memo.longest_prefix("s") is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from slime.backends.embedded.engine import EmbeddedEngine, EngineConfig
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("text_continuations") / "model"))
    engine = EmbeddedEngine(EngineConfig(model_path=path))
    yield engine
    engine.shutdown()


def _post_text(engine, text, seed):
    req = engine.make_request(None, {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": seed,
                                     "no_stop_trim": True, "skip_special_tokens": False}, True, None, text)
    engine.submit(req).done.wait()
    return req, engine.response(req)


def test_text_turns_condition_on_the_ids_the_plugin_assembles(tiny):
    """Three model turns around two observations, the way upstream's search-r1 example builds a sample. The
    tiny word-level tokenizer re-splits the joined text (a decoded turn followed by '.' merges into one unknown
    word), so tokenizing the text afresh gives other ids; the engine's inputs and log-probs must be the
    assembled ones', compared with one forward of the model over the whole assembled sequence (float32: the tiny
    MoE's grouped matmul takes no float64; a turn conditioned on re-tokenized text is off by 1e-2 and more)."""
    tok, rng = tiny.tokenizer, random.Random(0)
    prompt = tok.apply_chat_template([{"role": "user", "content": "a b c"}], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    for seed in range(3):
        response, ids, log_probs, trained, fresh_differs = "", list(prompt_ids), [], [], False
        for turn in range(3):
            fresh_differs |= tok(prompt + response, add_special_tokens=False)["input_ids"] != ids
            req, out = _post_text(tiny, prompt + response, seed * 3 + turn)
            assert req.input_ids == ids and out["meta_info"]["prompt_tokens"] == len(ids)
            pairs = out["meta_info"]["output_token_logprobs"]
            trained += range(len(ids), len(ids) + len(pairs))
            response, ids = response + out["text"], ids + [p[1] for p in pairs]
            log_probs += [p[0] for p in pairs]
            observation = f".\n<obs> {rng.randint(0, 9)} ."
            response, ids = response + observation, ids + tok(observation, add_special_tokens=False)["input_ids"]
        assert fresh_differs, "the case must be one that re-tokenizing gets wrong"
        with torch.no_grad():
            ref = torch.log_softmax(tiny.model(torch.tensor([ids])).logits[0].double(), -1)
        expected = [float(ref[i - 1, ids[i]]) for i in trained]
        assert max(abs(a - b) for a, b in zip(expected, log_probs)) < 1e-5


def _bos_template_tokenizer():
    """The tiny tokenizer made like Llama 3's: it adds <bos> to every text by default (a post-processor) and its
    chat template starts with <bos> as well, so tokenizing a templated prompt with special tokens gives two."""
    from tokenizers import processors

    from slime.utils.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer()
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok.chat_template = "<bos> " + tok.chat_template
    return tok, bos


def test_a_first_text_turn_is_tokenized_as_the_trainer_tokenizes_the_prompt(tiny, monkeypatch):
    """A text request that continues nothing (a multi-turn plugin's first turn) is the prompt the plugin trains on,
    tokenizer(prompt, add_special_tokens=False) as upstream's generate functions and slime's data source tokenize
    it: the template's one BOS, not a second one the tokenizer would add (SGLang's text /generate adds the
    tokenizer's special tokens); the second turn continues those ids."""
    tok, bos = _bos_template_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "a b c"}], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert prompt_ids[:2] == [bos, prompt_ids[1]] and prompt_ids[1] != bos  # the template's BOS, once
    assert tok(prompt)["input_ids"] == [bos] + prompt_ids  # the tokenizer's default adds another
    monkeypatch.setattr(tiny, "tokenizer", tok)
    req, out = _post_text(tiny, prompt, seed=5)
    assert req.input_ids == prompt_ids and out["meta_info"]["prompt_tokens"] == len(prompt_ids)
    ids = prompt_ids + [p[1] for p in out["meta_info"]["output_token_logprobs"]]
    observation = " . <obs> 3 ."
    req, _ = _post_text(tiny, prompt + out["text"] + observation, seed=6)
    assert req.input_ids == ids + tok(observation, add_special_tokens=False)["input_ids"]
