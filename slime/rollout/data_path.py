"""The rollout manager's data path: prompts (`--prompt-data`, the manager's data source, saved with
checkpoints), one rollout over the engine fleet (the generation loop, slime.rollout.streaming, over the built-in
transport, slime.rollout.generate, or over upstream's plugin contracts, slime.rollout.plugin_rollout; or samples
saved by --save-debug-rollout-data), rewards, and the
training data the trainer ranks read (flat arrays, slime.rollout.train_payload); and evaluation
(slime.rollout.evaluation, or upstream's eval function).

The fleet is the manager's engine fleet (slime.ray.engine_fleet.RolloutEngines): the generation loop's
`EngineFleet` plus the plugins' address; the calls a rollout makes around generation (re-admit re-synced engines,
note the weight versions, count restarts, run the health checks while generating) go to its `recovery`
(slime.ray.engine_recovery.EngineRecovery).
"""

from __future__ import annotations

from typing import Any

from slime.rollout.errors import RolloutError
from slime.rollout.generate import RolloutCounters, generate_rollout
from slime.rollout.rewards import reward_value


def global_prompt_source(args: Any, tokenizer: Any):
    """The run's prompts (--prompt-data); None under --disable-rollout-global-dataset (the rollout function's
    data) or without --prompt-data."""
    from slime.rollout.data_source import prompt_source

    if not args.rollout_global_dataset:  # --disable-rollout-global-dataset: the rollout function's data
        return None
    return prompt_source(args, tokenizer) if args.prompt_data else None


def common_version(samples) -> float:
    """The weight version every generation turn of the rollout ran on (a synced version number); -1 when the
    turns differ (an engine synced or restarted mid-rollout) or a version is not a number (initial weights)."""
    versions = {str(v) for s in samples for v in s.weight_versions}
    if len(versions) == 1 and next(iter(versions)).isdigit():
        return float(next(iter(versions)))
    return -1.0


class RolloutDataPath:
    def __init__(self, args: Any) -> None:
        from transformers import AutoTokenizer

        from slime.rollout.rewards import get_reward_fn

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        self.reward_fn = get_reward_fn(args) if (args.rm_type or args.custom_rm_path) else None
        if args.http_proxy or args.use_distributed_post:  # the built-in loop's reward posts go through http_utils too
            from slime.utils.http_utils import init_http_client

            init_http_client(args)
        self.data_source = global_prompt_source(args, self.tokenizer)
        self.progress: RolloutCounters | None = None  # of the rollout in progress
        self._plugin_data_source = None  # upstream's data source, made on the first plugin rollout
        self._eval_sets = None  # loaded on the first eval

    # ------------------------------------------------------------------ a training rollout
    def rollout(self, rollout_id: int, fleet: Any) -> tuple[list, dict[str, float]]:
        """The rollout's samples (generated and rewarded) and its metrics, restarts of the fleet included."""
        from slime.rollout.plugin_rollout import uses_plugin_rollout

        if self.args.load_debug_rollout_data:  # replay: the saved samples instead of the engines' (upstream's)
            from slime.rollout import debug_data

            fleet.recovery.rollout_id = rollout_id
            return debug_data.load_rollout(self.args.load_debug_rollout_data, rollout_id,
                                           self.args.load_debug_rollout_data_subsample), {}
        plugin = uses_plugin_rollout(self.args)
        own_data = self.args.data_source_path or not self.args.rollout_global_dataset  # the plugin's own prompts
        if self.data_source is None and not (plugin and own_data):
            raise RolloutError("no prompts: pass --prompt-data")
        if not fleet.n and not plugin:
            raise RolloutError("--debug-train-only starts no rollout engine: replay saved rollouts with "
                               "--load-debug-rollout-data PATH, or name a --rollout-function-path that needs none "
                               "(e.g. slime.rollout.sft_rollout.generate_rollout)")
        fleet.recovery.refresh_versions()
        health = fleet.recovery.note_current_versions()
        fleet.recovery.rollout_id = rollout_id
        from slime.rollout.sample_hooks import set_current_rollout_id

        set_current_rollout_id(rollout_id)
        self.progress = RolloutCounters()
        before = fleet.recovery.restart_counters()
        fleet.recovery.health_resume()  # until the engines are offloaded or the weight sync begins (upstream's window)
        if plugin:
            samples, metrics = self._plugin_rollout(rollout_id, fleet)
        else:
            samples, metrics = generate_rollout(self.args, fleet, self.data_source, self.tokenizer, self.reward_fn,
                                                self.progress, health=health)
        metrics.update(fleet.recovery.restart_metrics(before))
        if self.reward_fn is not None:
            rewards = [reward_value(s.reward, self.args.reward_key) for s in samples]
            metrics["rollout/raw_reward_mean"] = sum(rewards) / len(rewards)
        return samples, metrics

    def _plugin_args(self, fleet: Any, counters: RolloutCounters):
        """Upstream's plugin contracts (slime.rollout.plugin_rollout): args naming the router (the fleet proxy,
        which counts its re-sent requests in `counters`), and upstream's data source (made once, over the
        manager's prompts)."""
        from slime.rollout import plugin_rollout

        args = plugin_rollout.plugin_args(self.args, fleet.plugin_url(counters), fleet.n, fleet.clients)
        if self._plugin_data_source is None:
            self._plugin_data_source = plugin_rollout.make_data_source(args, self.data_source, self.tokenizer)
        return args

    def _plugin_rollout(self, rollout_id: int, fleet: Any):
        from slime.rollout import plugin_rollout

        args = self._plugin_args(fleet, self.progress)
        try:
            samples, metrics = plugin_rollout.run_plugin_rollout(args, rollout_id, self._plugin_data_source)
        except Exception as e:
            fatal = fleet.plugin_failure()  # the cause, rather than the plugin's last failed request
            if fatal is not None:
                raise fatal from e
            raise
        if fleet.plugin_failure() is not None:  # a plugin that caught its failed requests
            raise fleet.plugin_failure()
        metrics["rollout/reissued_requests"] = float(self.progress.reissued)  # as the built-in transport's
        return samples, metrics

    def train_data(self, rollout_id: int, samples: list, metrics: dict[str, Any], started: float):
        """The trainer's payload of the rollout's samples (flat arrays; --custom-convert-samples-to-train-data-path
        when set) and the rollout's metrics with the payload's summary. started: the rollout's wall-clock start."""
        import time

        from slime.rollout.train_payload import pack_samples, payload_summary
        from slime.rollout import debug_data
        from slime.rollout.plugin_rollout import log_rollout, post_process_rewards, train_data_payload
        from slime.rollout.rollout_metrics import rollout_metrics

        debug_data.save_rollout(self.args.save_debug_rollout_data, samples, rollout_id)  # before packing (upstream)
        # wall-clock bounds and the engines' weight version, for loops that overlap rollout and training
        metrics.update({"rollout/start_time": started, "rollout/end_time": time.time(),
                        "rollout/weight_version": common_version(samples)})
        payload = train_data_payload(self.args, samples)  # --custom-convert-samples-to-train-data-path
        if payload is None:
            payload = pack_samples(samples, self.args.reward_key)
            metrics.update(post_process_rewards(self.args, samples, payload))  # --custom-reward-post-process-path
        metrics.update(payload_summary(payload))
        metrics.update(rollout_metrics(self.args, samples))  # --log-passrate, --log-multi-turn, ...
        metrics = log_rollout(self.args, rollout_id, samples, metrics, time.time() - started)
        return payload, metrics

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, rollout_id: int, fleet: Any) -> dict[str, float]:
        """Evaluation rollouts on --eval-prompt-data with the eval sampling flags (slime.rollout.evaluation),
        or upstream's eval function."""
        from slime.rollout import debug_data, plugin_rollout
        from slime.rollout.evaluation import evaluate, load_eval_sets
        from slime.rollout.sample_hooks import set_current_rollout_id

        set_current_rollout_id(rollout_id)  # what --rollout-sample-hook-path hooks get as rollout_id
        fleet.recovery.health_resume()
        if plugin_rollout.uses_plugin_eval(self.args):  # upstream's eval function contract
            fleet.recovery.refresh_versions()
            fleet.recovery.rollout_id = rollout_id
            args = self._plugin_args(fleet, RolloutCounters())
            return plugin_rollout.run_plugin_eval(args, rollout_id, self._plugin_data_source)
        if self._eval_sets is None:
            self._eval_sets = load_eval_sets(self.args, self.tokenizer)
        fleet.recovery.refresh_versions()
        fleet.recovery.rollout_id = rollout_id
        data: dict = {}
        metrics = evaluate(self.args, fleet, self._eval_sets, self.tokenizer, self.reward_fn, data)
        debug_data.save_eval(self.args.save_debug_rollout_data, data, rollout_id)
        return plugin_rollout.log_eval(self.args, rollout_id, data, None, metrics)  # --custom-eval-rollout-log-...

    # ------------------------------------------------------------------ the prompts' position (checkpoints)
    def state(self) -> dict[str, Any] | None:
        return None if self.data_source is None else self.data_source.state_dict()

    def load_state(self, state: dict[str, Any] | None) -> None:
        if state is not None and self.data_source is not None:
            self.data_source.load_state_dict(state)
