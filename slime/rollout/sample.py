"""The rollout's sample type is upstream slime's `slime.utils.types.Sample` (one type for the project and
its plugins); `SampleStatus` is its `Sample.Status`."""

from slime.utils.types import Sample

SampleStatus = Sample.Status

__all__ = ["Sample", "SampleStatus"]
