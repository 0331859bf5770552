"""Mixture-of-experts layers with expert parallelism: router, all-to-all dispatch/combine, stacked experts."""
from .dispatch import all_to_all, combine, dispatch
from .experts import ExpertParallel, StackedDenseExperts, StackedExperts
from .grouped_mm import grouped_mm, set_expert_implementation
from .router import TopKRouter, drop_over_capacity, load_balancing_loss, router_jitter, router_z_loss

__all__ = ["TopKRouter", "StackedExperts", "StackedDenseExperts", "ExpertParallel", "dispatch", "combine",
           "all_to_all", "grouped_mm", "set_expert_implementation", "drop_over_capacity", "load_balancing_loss",
           "router_jitter", "router_z_loss"]
