"""Every `from slime... import name` of upstream's examples (upstream 624b824a8, examples/*/*.py, read with `ast`)
imports from this project (NOT_PROVIDED would list what does not, checked to be absent so the list and
docs/plugins.md stay true: it is empty)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
# (module, name or None for `import module`) -> the upstream examples that import it
EXAMPLE_IMPORTS = {
    ("slime.agent", "sandbox"): ["coding_agent_rl"],
    ("slime.agent.adapters", "AnthropicAdapter"): ["coding_agent_rl"],
    ("slime.agent.adapters", "OpenAIAdapter"): ["coding_agent_rl"],
    ("slime.agent.adapters.common", "flatten_content"): ["coding_agent_rl"],
    ("slime.agent.aiohttp_threaded", "FilteredAccessLogger"): ["coding_agent_rl"],
    ("slime.agent.aiohttp_threaded", "run_app_in_thread"): ["coding_agent_rl"],
    ("slime.agent.harness", "ClaudeCodeHarness"): ["coding_agent_rl"],
    ("slime.agent.harness", "CodexHarness"): ["coding_agent_rl"],
    ("slime.agent.sandbox", "E2BSandbox"): ["coding_agent_rl"],
    ("slime.agent.sandbox", "Sandbox"): ["coding_agent_rl"],
    ("slime.agent.sandbox", "exec_and_wait"): ["coding_agent_rl"],
    ("slime.backends.megatron_utils.cp_utils", "all_gather_with_cp"): ["train_infer_mismatch_helper"],
    ("slime.backends.megatron_utils.cp_utils", "slice_log_prob_with_cp"): ["train_infer_mismatch_helper"],
    ("slime.rollout.rm_hub", "batched_async_rm"): ["multi_agent"],
    ("slime.rollout.rm_hub", "grade_answer_verl"): ["geo3k_vlm_multi_turn"],
    ("slime.rollout.rm_hub.math_dapo_utils", "compute_score"): ["retool", "strands_sglang"],
    ("slime.rollout.rm_hub.math_utils", "extract_answer"): ["geo3k_vlm_multi_turn"],
    ("slime.rollout.sglang_rollout", "GenerateState"): ["geo3k_vlm_multi_turn", "retool", "search-r1",
                                                        "strands_sglang", "tau-bench"],
    ("slime.utils.http_utils", "post"): ["geo3k_vlm_multi_turn", "multi_agent", "retool", "search-r1", "tau-bench"],
    ("slime.utils.misc", None): ["geo3k_vlm_multi_turn"],
    ("slime.utils.misc", "SingletonMeta"): ["coding_agent_rl"],
    ("slime.utils.misc", "load_function"): ["multi_agent"],
    ("slime.utils.processing_utils", "build_processor_kwargs"): ["geo3k_vlm_multi_turn"],
    ("slime.utils.processing_utils", "encode_image_for_rollout_engine"): ["geo3k_vlm_multi_turn"],
    ("slime.utils.processing_utils", "load_tokenizer"): ["coding_agent_rl"],
    ("slime.utils.types", "Sample"): ["coding_agent_rl", "geo3k_vlm_multi_turn", "multi_agent", "retool",
                                      "search-r1", "strands_sglang", "tau-bench"],
    ("slime.utils.external_utils.command_utils", "execute_train"): ["geo3k_vlm_multi_turn"],
}
# modules upstream's examples import that this project does not provide (checked to be absent): none
NOT_PROVIDED: set[str] = set()
CASES = sorted(EXAMPLE_IMPORTS, key=lambda k: (k[0], k[1] or ""))


@pytest.mark.parametrize("module, name", CASES, ids=[f"{m}.{n}" for m, n in CASES])
def test_example_import(module, name):
    if module in NOT_PROVIDED:
        assert importlib.util.find_spec(module.rsplit(".", 1)[0]) is None or \
            importlib.util.find_spec(module) is None, f"{module} now exists: take it off NOT_PROVIDED"
        return
    mod = importlib.import_module(module)
    if name is not None:
        assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}") is not None, f"{module}.{name}"
