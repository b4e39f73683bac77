"""docs/flags.md's table of every flag upstream slime's slime/utils/arguments.py defines: implemented here (with
the --help group describing it), or refused with the reason. Upstream's list is test data (tests/data/
upstream_arguments_flags.json, read from its source at the commit it names); tests/test_flag_table.py keeps the
table, REFUSED and the parser in agreement.

    python -m slime.config.flag_table          rewrite the table in docs/flags.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UPSTREAM_FLAGS = os.path.join(ROOT, "tests", "data", "upstream_arguments_flags.json")
DOC = os.path.join(ROOT, "docs", "flags.md")
BEGIN, END = "<!-- upstream-flags:begin (python -m slime.config.flag_table) -->", "<!-- upstream-flags:end -->"

_HOOK = "upstream's customization hook; not built here yet"
_SYNC = "weight updates go trainer -> engines by IPC, a broadcast group or a checkpoint on disk " \
        "(--update-weight-mode ipc / distributed / disk); upstream's delta transport is not built"
_DEBUG = "upstream's forge rollout replay is not built (--load-debug-rollout-data replays saved rollouts)"
_BUFFER = "upstream's external rollout buffer service is not built"
_DEEPGEMM = "DeepGEMM kernels are not integrated"
REFUSED: dict[str, str] = {
    "--qwen-gdn-backend": "Gated DeltaNet runs this project's chunked torch rule on every device; upstream's fla / "
                          "flashqla kernels are not integrated",
    "--update-weight-transport": _SYNC,
    "--update-weight-delta-encoding": _SYNC, "--update-weight-delta-checksum": _SYNC,
    "--custom-update-weight-post-write-path": _SYNC, "--update-weight-local-checkpoint-dir": _SYNC,
    "--release-train": "releasing the train actors between rollouts is not built (--offload-train offloads them)",
    "--custom-model-provider-path": _HOOK,
    "--recompute-loss-function": "the loss is computed once per micro-batch; recomputing it in backward is not built",
    "--rollout-external-engine-addrs": "engines started outside slime are not supported; slime starts them",
    "--multimodal-keys": "multimodal (vision) prompts are not supported", "--load-forge-rollout-data": _DEBUG,
    "--rollout-buffer-url": _BUFFER, "--fetch-trajectory-retry-times": _BUFFER,
    "--min-batch-collection-ratio": _BUFFER, "--rollout-task-type": _BUFFER,
    "--megatron-deepgemm-forward-layers": _DEEPGEMM, "--megatron-deepgemm-forward-modules": _DEEPGEMM,
    "--megatron-deepgemm-moe-forward-layers": _DEEPGEMM, "--megatron-deepgemm-moe-forward-modules": _DEEPGEMM,
}


def upstream_flags() -> dict:
    with open(UPSTREAM_FLAGS, encoding="utf-8") as f:
        return json.load(f)


def rows(parser: argparse.ArgumentParser | None = None) -> list[tuple[str, str, str]]:
    """(flag, "implemented" | "refused", the --help group that defines it here, or the reason), in upstream's
    file order."""
    if parser is None:
        from slime.config.arguments import build_parser

        parser = build_parser()
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    out = []
    for entry in upstream_flags()["flags"]:
        flag = entry["flag"]
        action = parser._option_string_actions.get(flag)
        if action is not None:
            out.append((flag, "implemented", f"`train.py --help`: {group_of.get(id(action), 'options')}"))
        else:
            out.append((flag, "refused", REFUSED.get(flag, "")))
    return out


def render(table: list[tuple[str, str, str]]) -> str:
    data = upstream_flags()
    done = sum(status == "implemented" for _, status, _ in table)
    lines = [BEGIN, "",
             f"{done} of the {len(table)} flags upstream's `{data['file']}` defines (THUDM/slime "
             f"{data['commit'][:9]}) are implemented; the others are refused by the parser (one line naming the "
             "flag), for the reason given.", "",
             "| upstream flag | here | where it is documented, or why refused |", "|---|---|---|"]
    lines += [f"| `{flag}` | {status} | {text} |" for flag, status, text in table]
    return "\n".join(lines + ["", END])


def write_doc(path: str = DOC) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    table = render(rows())
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + table + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n## Every upstream flag\n\n" + table + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    write_doc(sys.argv[1] if len(sys.argv) > 1 else DOC)
