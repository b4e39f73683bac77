"""Rollout side: prompts (data source), generation over SGLang-protocol engines, rewards, samples."""

from slime.rollout.sample import Sample, SampleStatus

__all__ = ["Sample", "SampleStatus"]
