"""docs/flags.md's table of upstream's flags is generated and true: every flag upstream's slime/utils/arguments.py
defines (tests/data/upstream_arguments_flags.json) is implemented by the parser or refused with a reason."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_upstream_flag_list_names_its_commit():
    from slime.config.flag_table import upstream_flags

    data = upstream_flags()
    assert data["repository"] == "THUDM/slime" and len(data["commit"]) == 40
    flags = [f["flag"] for f in data["flags"]]
    assert len(flags) == 202 == len(set(flags)) and all(f.startswith("--") for f in flags)


def test_every_upstream_flag_is_implemented_or_refused_with_a_reason():
    from slime.config.arguments import build_parser
    from slime.config.flag_table import REFUSED, rows

    parser = build_parser()
    table = rows(parser)
    refused = {flag for flag, status, _ in table if status == "refused"}
    assert all(REFUSED.get(f) for f in refused), sorted(f for f in refused if not REFUSED.get(f))
    assert set(REFUSED) <= {f for f, _, _ in table}
    assert not [f for f in REFUSED if f not in refused], "REFUSED names implemented flags"
    assert sum(status == "implemented" for _, status, _ in table) >= 180


def test_docs_table_is_the_generated_one():
    from slime.config.flag_table import BEGIN, END, render, rows

    text = (ROOT / "docs/flags.md").read_text()
    assert BEGIN in text and END in text
    shown = text[text.index(BEGIN):text.index(END) + len(END)]
    assert shown == render(rows()), "docs/flags.md is stale: python -m slime.config.flag_table"
