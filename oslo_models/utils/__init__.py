"""Small utilities shared by tests, benchmarks and examples."""
from .memory import PeakRSS

__all__ = ["PeakRSS"]
