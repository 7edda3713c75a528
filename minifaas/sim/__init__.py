"""The cluster simulator: workloads and traces replayed through the live router and prefix caches (no torch)."""

from minifaas.sim.arrivals import ArrivalKind, ArrivalSpec
from minifaas.sim.deployment import SimConfig, config_for
from minifaas.sim.fluid_link import LinkConfig
from minifaas.sim.report import SimResult
from minifaas.sim.simulator import Simulation
from minifaas.sim.workload import Workload, read_workload, synthetic

__all__ = [
    "ArrivalKind",
    "ArrivalSpec",
    "LinkConfig",
    "SimConfig",
    "SimResult",
    "Simulation",
    "Workload",
    "config_for",
    "read_workload",
    "synthetic",
]
