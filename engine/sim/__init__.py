"""Virtual-time replicas for ``iterserve simulate``: cost models and a runner without a model."""

from engine.sim.cost import FEATURES, CostModel, LinearCost, RooflineCost, StepShape, fit_linear
from engine.sim.runner import SimClock, SimRunner, SimTokenizer, sim_engine

__all__ = [
    "FEATURES",
    "CostModel",
    "LinearCost",
    "RooflineCost",
    "SimClock",
    "SimRunner",
    "SimTokenizer",
    "StepShape",
    "fit_linear",
    "sim_engine",
]
