"""This machine's sizes (memory, a filesystem) and the folders a disk tier may use, read from the OS alone: the
engine's tiers and the config's checks both ask, and neither may pull in the other's imports (the engine runs
without pydantic)."""

from __future__ import annotations

import os
from pathlib import Path

# Folders a disk tier may not be in: the system's own (``/usr/...``, ``/dev/null``, ``/proc/...``).
_SYSTEM_DIRS = "/bin /boot /dev /etc /lib /lib32 /lib64 /libx32 /proc /run /sbin /sys /usr".split()
# Folders a disk tier may be under but not be: shared by everything else on the machine.
_SHARED_DIRS = frozenset("/ /home /media /mnt /opt /root /srv /tmp /var /var/tmp /var/cache /var/lib /var/log".split())


def disk_tier_path(value: str) -> str:
    """A disk tier's folder: ``value`` with ``~`` expanded, normalised. ``ValueError`` for a relative path, a
    ``..`` component, a system folder or a path in one (also where a symlink leads), a shared top folder itself
    (``/``, ``/tmp``, ``/var``, ``/home``, ...), or something that exists and is not a folder (``/dev/null``)."""
    expanded = os.path.expanduser(value)
    if not os.path.isabs(expanded):
        raise ValueError(f"must be an absolute path (or start with ~/), got {value!r}")
    if ".." in Path(expanded).parts:
        raise ValueError(f"must not hold '..' components, got {value!r}")
    path = os.path.normpath(expanded)
    for where in dict.fromkeys((path, os.path.realpath(path))):
        if where in _SHARED_DIRS:
            example = "/var/cache/kvgrid" if where == "/" else f"{where}/kvgrid"
            raise ValueError(f"must be a folder of its own (e.g. {example}), not {where}")
        system = next((d for d in _SYSTEM_DIRS if where == d or where.startswith(d + "/")), None)
        if system is not None:
            raise ValueError(f"must not be in the system folder {system}, got {value!r}")
        if os.path.exists(where) and not os.path.isdir(where):
            raise ValueError(f"{where} exists and is not a folder")
    return path


def memory_bytes() -> int | None:
    """This machine's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def filesystem_bytes(path: str) -> int | None:
    """The size of the filesystem ``path`` is on (or would be, by its nearest existing folder)."""
    p = Path(path)
    try:
        while not p.exists() and p != p.parent:
            p = p.parent
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize
