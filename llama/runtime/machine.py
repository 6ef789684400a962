"""What this machine has of memory, and the one-line refusal of what does not fit: checked before the large
allocations, so that a run too big for the machine ends in one line instead of a MemoryError or the kernel's OOM
killer.

Host memory available is the least of: MemAvailable in /proc/meminfo (else the free pages that
os.sysconf counts), a container's cgroup limit less its usage, and the address-space limit (ulimit -v)
less what this process already maps. GPU memory available is what the driver reports free.
"""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

from .cuda import runtime

# cgroup v2, then v1: (limit, usage) as a container sees them
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


class NotEnoughMemory(MemoryError):
    """A run or a model that does not fit in this machine's memory, found before allocating it; the
    message is one line."""


def size_text(nbytes: float) -> str:
    """Bytes in binary units, e.g. '3.2 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:,.1f} {unit}"
        nbytes /= 1024


def _meminfo_available() -> int | None:
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        found = None
    if found:
        return int(found.group(1)) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _cgroup_room() -> int | None:
    """A container's memory limit less its usage; None where there is no limit."""
    for limit_path, usage_path in CGROUP_FILES:
        try:
            limit, usage = Path(limit_path).read_text().strip(), Path(usage_path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:  # 'max', or v1's huge "no limit"
            return max(int(limit) - int(usage), 0)
    return None


def _address_space_room() -> int | None:
    """The address-space limit (ulimit -v) less what this process maps; None where it is unlimited."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        mapped = int(re.search(r"^VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024
    except (OSError, AttributeError):
        mapped = 0
    return max(limit - mapped, 0)


def host_available() -> int | None:
    """Bytes this process can still allocate on the host; None when nothing says."""
    known = [room for room in (_meminfo_available(), _cgroup_room(), _address_space_room()) if room is not None]
    return min(known) if known else None


def gpu_free() -> int:
    """Bytes free on this process's GPU."""
    return runtime().drv.mem_get_info()[0]


def require(needed: int, available: int | None, what: str, where: str, advice: str = "",
            lower_bound: bool = False) -> str:
    """The line that says what `what` needs of the `where` memory (about, or at least with lower_bound)
    and how much is available; NotEnoughMemory (with advice) when it does not fit."""
    have = f"{size_text(available)} available" if available is not None else "availability unknown"
    line = f"{what} needs {'at least' if lower_bound else 'about'} {size_text(needed)} of {where} memory, {have}"
    if available is not None and needed > available:
        raise NotEnoughMemory(line + (f"; {advice}" if advice else ""))
    return line
