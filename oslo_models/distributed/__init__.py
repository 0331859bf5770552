"""Process groups and the DeviceMesh built from a ParallelConfig; nothing global."""
from .context import MESH_AXES, ParallelContext, init_process_group_from_environment
from .data_parallel import data_parallel, gradients_reduced_by, mark_gradients_reduced
from .watchdog import CollectiveTimeoutError, raise_for_timeout, timeout_report

__all__ = ["MESH_AXES", "CollectiveTimeoutError", "ParallelContext", "data_parallel", "gradients_reduced_by",
           "mark_gradients_reduced", "init_process_group_from_environment", "raise_for_timeout", "timeout_report"]
