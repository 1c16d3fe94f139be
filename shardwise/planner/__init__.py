"""The planner: hardware specs, a memory model, a time model and a search over layouts.

Pure Python (no torch), so `shardwise estimate`/`plan` run anywhere and fast.
"""

from shardwise.planner.estimate import Estimate, estimate, estimate_from_specs
from shardwise.planner.hardware import Hardware, resolve_hardware
from shardwise.planner.layout import Layout, layout_from_dict
from shardwise.planner.model_resolution import resolve_model, resolve_model_and_name

__all__ = ["Estimate", "Hardware", "Layout", "estimate", "estimate_from_specs", "layout_from_dict", "resolve_hardware",
           "resolve_model", "resolve_model_and_name"]
