"""slime's layout verdict equals Megatron-core's: `parallel_state.initialize_model_parallel` itself runs on a fake
world (torch.distributed's world size, rank and group creation replaced; no process starts), and raises exactly
for the layouts slime.config.megatron_layout refuses, with the same message. Upstream's single-node
GLM-4.7-30B-A3B layout (TP2 PP2 CP2 EP8 on 8 devices) is one Megatron refuses; the dry run says so."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from slime.config.megatron_layout import ParallelLayout, megatron_refusal

LAYOUTS = [
    ParallelLayout(8, tp=2, pp=2, cp=2, ep=8, etp=1),  # run-glm4.7-30B-A3B.sh on its 8 devices
    ParallelLayout(16, tp=2, pp=2, cp=2, ep=8, etp=1),  # the same on two nodes
    ParallelLayout(8, tp=2, pp=1, cp=2, ep=8, etp=1),  # EP folds over TP x CP x DP of one stage
    ParallelLayout(8, tp=2, pp=2, cp=2, ep=4),  # expert-TP defaults to TP: 2 x 4 x 2 = 16
    ParallelLayout(12, tp=2, pp=3, ep=2, etp=1),
    ParallelLayout(12, tp=4, pp=2),  # decoder grid 8 does not divide 12
    ParallelLayout(8, tp=2, vpp=2),  # virtual pipeline without PP
    ParallelLayout(256, tp=4, pp=4, cp=2, ep=32, etp=1),  # run-glm5-744B-A40B.sh
    ParallelLayout(256, tp=4, pp=4, cp=2, ep=128, etp=1),
]


def _megatron_verdict(layout: ParallelLayout, monkeypatch) -> str | None:
    """Megatron-core's own initialize_model_parallel on a fake world of `layout.world` ranks (we are rank 0)."""
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: layout.world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: object())
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", lambda *a, **k: (object(), []), raising=False)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
            create_gloo_process_groups=False)
    except (RuntimeError, AssertionError) as e:
        return str(e)
    finally:
        ps.destroy_model_parallel()
    return None


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"w{x.world}-tp{x.tp}-pp{x.pp}-cp{x.cp}-ep{x.ep}-etp{x.etp}"
                                                            f"-vpp{x.vpp}")
def test_same_verdict_as_megatron_initialize_model_parallel(layout, monkeypatch):
    assert megatron_refusal(layout) == _megatron_verdict(layout, monkeypatch)


def test_the_handful_has_both_verdicts():
    verdicts = [megatron_refusal(x) is None for x in LAYOUTS]
    assert 3 <= sum(verdicts) <= len(LAYOUTS) - 3
    assert megatron_refusal(LAYOUTS[0]) == ("world_size (8) is not divisible by "
                                            "expert_tensor_model_pipeline_parallel size (16)")
