"""`train.py --help`: each option's default appears at most once, and never as "(default: None)"."""

import re

from slime.config.arguments import build_parser


def test_each_default_once():
    text = build_parser().format_help()
    blocks = re.split(r"\n  (?=-)", text)  # one block per option
    assert len(blocks) > 50
    assert not [b.split()[0] for b in blocks if b.count("default") > 1]
    assert "(default: None)" not in text and "(default: False)" not in text
    concurrency = next(b for b in blocks if b.startswith("--max-concurrency "))
    assert " ".join(concurrency.split()).endswith("(default: 64)")
