"""How far to draft each round, and from which source: costs (costs.py), the draft's
calibrated acceptance (acceptance.py), and the policies that decide from them (policy.py)."""

from .acceptance import CONFIDENCE_EDGES, N_EXPLORE, Acceptance
from .costs import MIN_RATIO, Costs, OnlineCosts, draft_can_pay, planning_load
from .policy import Controller, FixedDraft, Policy

__all__ = ["Acceptance", "CONFIDENCE_EDGES", "Controller", "Costs", "FixedDraft", "MIN_RATIO", "N_EXPLORE",
           "OnlineCosts", "Policy", "draft_can_pay", "planning_load"]
