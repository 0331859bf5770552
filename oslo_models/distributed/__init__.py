"""Process groups and the DeviceMesh built from a ParallelConfig; nothing global."""
from .context import MESH_AXES, ParallelContext
from .data_parallel import data_parallel

__all__ = ["MESH_AXES", "ParallelContext", "data_parallel"]
