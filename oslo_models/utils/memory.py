"""Peak resident memory of the calling process over a block (Linux ``/proc``)."""
from __future__ import annotations


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


class PeakRSS:
    """``with PeakRSS() as peak: ...`` then ``peak.growth_bytes``: the highest RSS reached inside the block minus
    the RSS at its start. Resets the kernel's high-water mark (``/proc/self/clear_refs``) on entry, so memory
    used before the block (imports) does not hide what the block itself needs."""

    def __enter__(self) -> "PeakRSS":
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")  # reset VmHWM to the current RSS
        self.start_bytes = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        self.peak_bytes = _status_kib("VmHWM") * 1024
        self.growth_bytes = self.peak_bytes - self.start_bytes
