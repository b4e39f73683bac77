"""slime.utils.processing_utils against upstream's on the same inputs (tests/data/upstream_processing_utils_cases.json,
recorded by tests/data/record_upstream_processing_utils_cases.py from upstream's file at the commit it names): the
processor call's keyword arguments, images encoded for the engine (decoded pixels), images pulled out of chat
messages (data URI, bare base64, a file path, a PIL image), and a text checkpoint having no processor."""

from __future__ import annotations

import base64
import io
import json
import os
from types import SimpleNamespace

import pytest

from slime.utils import processing_utils as pu

Image = pytest.importorskip("PIL.Image")

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_processing_utils_cases.json")) as f:
    RECORD = json.load(f)


def cases(fn):
    return [c for c in RECORD["cases"] if c["fn"] == fn]


def image(mode, size, seed):  # the recording's images
    img = Image.new(mode, size)
    img.putdata([(seed * 37 + i * 11) % 256 if mode in ("L", "P") else
                 tuple((seed * 37 + i * 11 + c * 53) % 256 for c in range(len(mode))) for i in range(size[0] * size[1])])
    return img


def facts(img):
    return [img.mode, list(img.size), img.tobytes().hex()]


@pytest.mark.parametrize("case", cases("encode_image_for_rollout_engine"), ids=lambda c: c["image"][0])
def test_encoded_image_matches_upstream(case):
    mode, size, seed = case["image"]
    uri = pu.encode_image_for_rollout_engine(image(mode, tuple(size), seed))
    prefix, payload = uri.split(",", 1)
    assert prefix == case["prefix"]
    assert facts(Image.open(io.BytesIO(base64.b64decode(payload)))) == case["out"]


@pytest.mark.parametrize("case", cases("build_processor_kwargs"), ids=lambda c: json.dumps(c["input"]))
def test_processor_kwargs_match_upstream(case):
    given = None if case["input"] is None else json.loads(json.dumps(case["input"]))
    assert pu.build_processor_kwargs(given) == case["out"]
    assert given == case["input"]  # the caller's dict is not changed


@pytest.mark.parametrize("case", cases("process_vision_info"), ids=lambda c: str(len(c["prompt"])))
def test_vision_info_matches_upstream(case, tmp_path):
    path = str(tmp_path / "p.png")
    image("RGB", (2, 2), 9).save(path)

    def materialize(item):
        if not isinstance(item, dict) or "image" not in item:
            return item
        value = item["image"]
        if value == "PATH":
            value = path
        elif isinstance(value, dict):
            mode, size, seed = value["PIL"]
            value = image(mode, tuple(size), seed)
        return {**item, "image": value}

    prompt = [{**m, "content": [materialize(i) for i in m["content"]] if isinstance(m["content"], list)
               else m["content"]} for m in case["prompt"]]
    got = pu.process_vision_info(prompt, SimpleNamespace(image_processor=SimpleNamespace()))
    assert {"images": None if got["images"] is None else [facts(i) for i in got["images"]],
            "videos": got["videos"]} == case["out"]


def test_text_checkpoint_has_no_processor_and_loads_its_tokenizer(tmp_path):
    from slime.utils.tiny_tokenizer import save_tokenizer

    save_tokenizer(str(tmp_path / "tok"), vocab_size=300)
    outcomes = {c["dir"]: c["out"] for c in cases("load_processor")}
    assert (pu.load_processor(str(tmp_path / "tok")) is None) == outcomes["tiny_tokenizer(300)"]
    assert (pu.load_processor(str(tmp_path / "none")) is None) == outcomes["missing"]
    tok = pu.load_tokenizer(str(tmp_path / "tok"))
    (case,) = cases("load_tokenizer")
    assert [type(tok).__name__, tok("a b")["input_ids"]] == case["out"]
