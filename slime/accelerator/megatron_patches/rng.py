"""RNG: megatron's tracker saves/restores/seeds the CUDA generator; use the accelerator's generator."""

from __future__ import annotations

import contextlib

import torch

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.patches import Patch

RANDOM = "megatron.core.tensor_parallel.random"


def _acc():
    from slime.accelerator import get_accelerator

    return get_accelerator()


def _no_graph_safe(graph_safe: bool) -> None:
    if graph_safe:
        raise NotImplementedError(
            "graph-safe (CUDA-graph) RNG states need a CUDA device; set use_cudagraphable_rng=False"
        )


def get_device_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    _no_graph_safe(graph_safe)
    return _acc().get_rng_state()


def set_device_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    _no_graph_safe(graph_safe)
    _acc().set_rng_state(new_state)


def _seeded_state(seed: int) -> torch.Tensor:
    """Device generator state after seeding with `seed`; host and device generators are left unchanged."""
    acc = _acc()
    host, device = torch.get_rng_state(), acc.get_rng_state()
    acc.manual_seed(seed)
    state = acc.get_rng_state()
    acc.set_rng_state(device)
    torch.set_rng_state(host)
    return state


def tracker_add(self, name: str, seed: int) -> None:
    """Same bookkeeping as CudaRNGStatesTracker.add, seeding the accelerator's generator."""
    _no_graph_safe(getattr(self, "use_cudagraphable_rng", False))
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.seeds_.add(seed)
    self.states_[name] = _seeded_state(seed)


def make_tracker_fork(original):
    """On CPU the device generator IS the host generator, so megatron's "CPU RNG state changed within
    GPU RNG context" warning fires on every random op inside fork(); swap states without that check."""

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if _acc().device_type != "cpu":
            with original(self, name):
                yield
            return
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_name = self._current_state_name
        outer_state = get_device_rng_state()
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        set_device_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            set_device_rng_state(outer_state)
            self._current_state_name = outer_name

    return fork


def model_parallel_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                               use_cudagraphable_rng: bool = False, tp_rank=None, ep_rank=None, etp_rank=None,
                               force_reset_rng: bool = False) -> None:
    """megatron's model_parallel_cuda_manual_seed with the same seed layout (data / tensor / expert
    parallel states), seeding the accelerator instead of `torch.cuda.manual_seed`."""
    import importlib

    from megatron.core import parallel_state as ps

    random = importlib.import_module(RANDOM)
    _no_graph_safe(use_cudagraphable_rng)
    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = ps.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    random.initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
                                  force_reset=force_reset_rng)
    tracker = random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    _acc().manual_seed(seed)
    tracker.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def make_checkpoint_without_output_init(original):
    """CheckpointWithoutOutput.__init__ sets `self.fp8 = fp8 is not None`, True even for fp8=False, and its
    fp8 branch needs TransformerEngine's FP8GlobalStateManager (NameError without TE): keep the flag as given."""

    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = bool(fp8)

    return __init__


def _p(name, targets, replacement, why, replaces):
    return Patch(name=name, targets=tuple(targets), replacement=replacement, why=why, replaces=replaces,
                 versions=MEGATRON_VERSIONS,
                 remove_when="megatron-core takes the RNG generator from a device-agnostic accelerator API")


PATCHES = [
    Patch(name="checkpoint_without_output_fp8_flag", targets=(f"{RANDOM}:CheckpointWithoutOutput.__init__",),
          replacement=make_checkpoint_without_output_init,
          why="selective recompute of the layer norms (--recompute-modules layernorm) checkpoints them without output",
          replaces="`self.fp8 = fp8 is not None` (always True), whose fp8 path references TransformerEngine's "
                   "FP8GlobalStateManager, absent here (NameError)",
          versions=MEGATRON_VERSIONS, remove_when="megatron-core sets CheckpointWithoutOutput.fp8 from the fp8 argument"),
    _p("rng_get_state", [f"{RANDOM}:_get_cuda_rng_state"], lambda orig: get_device_rng_state,
       "the RNG tracker and activation checkpointing save the device generator state",
       "torch.cuda.random.get_rng_state (raises without CUDA)"),
    _p("rng_set_state", [f"{RANDOM}:_set_cuda_rng_state"], lambda orig: set_device_rng_state,
       "the RNG tracker and activation checkpointing restore the device generator state",
       "torch.cuda default_generators / _lazy_call (raises without CUDA)"),
    _p("rng_tracker_add", [f"{RANDOM}:CudaRNGStatesTracker.add"], lambda orig: tracker_add,
       "model_parallel_cuda_manual_seed registers per-parallel-group generator states",
       "torch.cuda.get_rng_state / torch.cuda.manual_seed in CudaRNGStatesTracker.add"),
    _p("rng_tracker_fork", [f"{RANDOM}:CudaRNGStatesTracker.fork"], make_tracker_fork,
       "on CPU the device generator is the host generator; the original warns on every random op inside fork",
       "the host-RNG-changed warning in CudaRNGStatesTracker.fork (delegates to the original off CPU)"),
    _p("model_parallel_manual_seed",
       [f"{RANDOM}:model_parallel_cuda_manual_seed"],
       lambda orig: model_parallel_manual_seed,
       "every trainer seeds the model-parallel RNG states at start-up",
       "torch.cuda.manual_seed in model_parallel_cuda_manual_seed"),
]
