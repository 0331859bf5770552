"""Process groups and the DeviceMesh built from a ParallelConfig; nothing global."""
from .context import MESH_AXES, ParallelContext

__all__ = ["MESH_AXES", "ParallelContext"]
