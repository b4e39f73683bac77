"""Memory and step-time planner for RL runs of GLM-5-family MoE models (`python -m slime.plan`).

Pure arithmetic on an HF config, a parallel layout and a device profile; imports no torch.
Formulas and their assumptions: docs/planner.md.
"""

from slime.plan.devices import DEVICES, DeviceProfile, get_device
from slime.plan.estimate import Plan, plan
from slime.plan.layout import Layout, RolloutSettings, TrainSettings
from slime.plan.model import ModelShape
from slime.plan.search import search

__all__ = ["DEVICES", "DeviceProfile", "Layout", "ModelShape", "Plan", "RolloutSettings", "TrainSettings",
           "get_device", "plan", "search"]
