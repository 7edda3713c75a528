"""The PrfaaS planner: the throughput model, its grid search and the named cases (no torch)."""

from minifaas.planner.case import PlanCase, load_case
from minifaas.planner.lengths import LengthDistribution
from minifaas.planner.model import OperatingPoint, operating_point, stages
from minifaas.planner.profile import DecodeProfile, PrefillProfile, ProfilePoint, load_profiles
from minifaas.planner.search import Plan, SearchGrid, best_homogeneous, best_prfaas, naive, plan

__all__ = [
    "DecodeProfile",
    "LengthDistribution",
    "OperatingPoint",
    "Plan",
    "PlanCase",
    "PrefillProfile",
    "ProfilePoint",
    "SearchGrid",
    "best_homogeneous",
    "best_prfaas",
    "load_case",
    "load_profiles",
    "naive",
    "operating_point",
    "plan",
    "stages",
]
