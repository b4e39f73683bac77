"""Records tests/data/upstream_processing_utils_cases.json: upstream slime's slime/utils/processing_utils.py
(which imports nothing of slime) run outside this repository, with the venv's transformers and Pillow and without
qwen_vl_utils, on the inputs below:
    git -C UPSTREAM show COMMIT:slime/utils/processing_utils.py > /tmp/up/processing_utils.py
    python tests/data/record_upstream_processing_utils_cases.py /tmp/up/processing_utils.py COMMIT OUT.json
Images are recorded as (mode, size, pixel bytes in hex); the tokenizer directory is
slime.utils.tiny_tokenizer.save_tokenizer's (a text checkpoint: no processor).
"""
import base64
import io
import json
import sys
import tempfile
import types
from types import SimpleNamespace

from PIL import Image

up = sys.modules["up"] = types.ModuleType("up")
exec(open(sys.argv[1]).read(), up.__dict__)


def image(mode, size, seed):
    img = Image.new(mode, size)
    img.putdata([(seed * 37 + i * 11) % 256 if mode in ("L", "P") else
                 tuple((seed * 37 + i * 11 + c * 53) % 256 for c in range(len(mode))) for i in range(size[0] * size[1])])
    return img


def facts(img):
    return [img.mode, list(img.size), img.tobytes().hex()]


def png_b64(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


SPECS = [("RGB", (3, 2), 1), ("RGBA", (2, 2), 2), ("L", (4, 1), 3), ("P", (2, 3), 4), ("LA", (1, 1), 5)]
cases = []
for spec in SPECS:
    uri = up.encode_image_for_rollout_engine(image(*spec))
    decoded = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    cases.append({"fn": "encode_image_for_rollout_engine", "image": list(spec), "prefix": uri.split(",", 1)[0],
                  "out": facts(decoded)})
for mm in (None, {}, {"images": ["x"]}, {"text_kwargs": {"padding": True, "return_tensors": "np"}},
           {"images_kwargs": {"max_pixels": 10, "return_tensors": "np"}, "videos_kwargs": {"fps": 2}},
           {"audio_kwargs": {}, "other": 1}):
    cases.append({"fn": "build_processor_kwargs", "input": mm, "out": up.build_processor_kwargs(mm)})
with tempfile.TemporaryDirectory() as tmp:
    path = f"{tmp}/p.png"
    image("RGB", (2, 2), 9).save(path)
    # a path string is recorded as the placeholder PATH: the test writes the same image to its own path
    PROMPTS = [
        [{"role": "user", "content": "text only"}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "image": "data:image/png;base64,"
                                        + png_b64(image("RGB", (2, 1), 6))}]}],
        [{"role": "user", "content": [{"type": "image", "image": png_b64(image("L", (3, 1), 7))},
                                       {"type": "image", "image": None}, {"type": "video", "video": "v"}, "str item"]},
         {"role": "assistant", "content": "ok"},
         {"role": "user", "content": [{"type": "image", "image": "PATH"}, {"type": "image", "image": {"PIL": ["RGBA", [1, 2], 8]}}]}],
        [],
    ]
    for prompt in PROMPTS:
        def real(p):
            out = []
            for m in p:
                c = m.get("content")
                if isinstance(c, list):
                    c = [dict(i, image=path if i.get("image") == "PATH" else image(i["image"]["PIL"][0], tuple(i["image"]["PIL"][1]), i["image"]["PIL"][2]) if isinstance(i.get("image"), dict) else i.get("image")) if isinstance(i, dict) and "image" in i else i for i in c]
                out.append({**m, "content": c})
            return out
        got = up.process_vision_info(real(prompt), SimpleNamespace(image_processor=SimpleNamespace()))
        cases.append({"fn": "process_vision_info", "prompt": prompt,
                      "out": {"images": None if got["images"] is None else [facts(i) for i in got["images"]],
                              "videos": got["videos"]}})
    sys.path.insert(0, ".")
    from slime.utils.tiny_tokenizer import save_tokenizer

    save_tokenizer(f"{tmp}/tok", vocab_size=300)
    cases.append({"fn": "load_processor", "dir": "tiny_tokenizer(300)", "out": up.load_processor(f"{tmp}/tok") is None})
    cases.append({"fn": "load_processor", "dir": "missing", "out": up.load_processor(f"{tmp}/none") is None})
    tok = up.load_tokenizer(f"{tmp}/tok")
    cases.append({"fn": "load_tokenizer", "dir": "tiny_tokenizer(300)", "out": [type(tok).__name__, tok("a b")["input_ids"]]})
json.dump({"repository": "THUDM/slime", "commit": sys.argv[2], "module": "slime/utils/processing_utils.py",
           "recorded_with": "upstream's file run on these inputs (transformers, Pillow; no qwen_vl_utils), outside "
           "this repository (the tokenizer directory is written by this project's tiny_tokenizer)",
           "cases": cases}, open(sys.argv[3], "w"), indent=0)
print(len(cases))
