"""The registry of the CPU shims and the megatron-core versions each is declared for.

The shim modules (``engine/cpu_shims.py``, ``engine/cpu_speed_shims.py``) register each shim here
with :func:`cpu_shim`, declaring the versions whose upstream code needs it (:class:`NeededOn`);
:func:`needed_here` is the one comparison with the installed version. :mod:`~megatron_gspo.engine.
compat` imports the shim modules and applies what is needed; this module sits below all three so
that none of them imports another in a circle.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from megatron.core import package_info


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.17.1"`` -> ``(0, 17, 1)`` (pre-release and local suffixes are not part of it)."""
    major, minor, patch = (text.split("+")[0].split(".") + ["0", "0"])[:3]
    return int(major), int(minor), int(re.match(r"\d*", patch).group() or 0)


MEGATRON_CORE_VERSION: tuple[int, int, int] = tuple(int(v) for v in package_info.VERSION[:3])
"""(major, minor, patch) of the installed megatron-core."""

OLDEST_SUPPORTED_VERSION = "0.16.1"
"""The oldest megatron-core megatron_gspo runs on (the first with ``RouterReplay``; setup.py's
lower bound)."""

CHECKED_VERSIONS = ("0.16.1", "0.17.1")
"""Every megatron-core version CI runs, each shim's declaration checked on it: 0.16.1 (Python
3.11 job; the newest for Python 3.11) and 0.17.1 (Python 3.12 job; the Docker image's). The
Python 3.12 job is ``.ci/run --py312``; docs/architecture.md has the versions policy."""


@dataclass(frozen=True)
class NeededOn:
    """The megatron-core versions whose upstream code needs a shim: ``since <= version <
    fixed_in`` (``fixed_in=None``: no release has fixed it yet)."""

    since: str = OLDEST_SUPPORTED_VERSION
    fixed_in: str | None = None

    def __contains__(self, version: tuple[int, int, int]) -> bool:
        return parse_version(self.since) <= version and (
            self.fixed_in is None or version < parse_version(self.fixed_in)
        )

    def __str__(self) -> str:
        return f">= {self.since}" + (f", < {self.fixed_in}" if self.fixed_in else "")


def needed_here(needed: NeededOn) -> bool:
    """Whether the installed megatron-core is one of ``needed``'s versions: the only place the
    installed version decides what gets patched."""
    return MEGATRON_CORE_VERSION in needed


@dataclass(frozen=True)
class Shim:
    name: str
    upstream: str
    """The upstream function(s) or call sites the shim covers."""
    apply: Callable[[], None]
    needed: NeededOn
    """The megatron-core versions whose upstream code needs it."""


SHIMS: list[Shim] = []
"""Every registered shim, in registration order (the shim modules' import order)."""


def cpu_shim(
    name: str, upstream: str, needed: NeededOn | None = None
) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register a shim, needed on ``needed`` (default: every supported version so far); its
    docstring gains the upstream place and those versions."""
    needed = needed or NeededOn()

    def register(function: Callable[[], None]) -> Callable[[], None]:
        function.__doc__ = (
            f"{(function.__doc__ or '').strip()}\n\nCovers: {upstream}.\n"
            f"Needed on megatron-core {needed} (checked on {', '.join(CHECKED_VERSIONS)})."
        )
        SHIMS.append(Shim(name, upstream, function, needed))
        return function

    return register


@dataclass(frozen=True)
class Workaround:
    """An upstream bug worked around on every device, CPU and GPU alike. Not applied by
    ``compat.apply_cpu_shims`` (CPU only): the code that builds what it concerns applies it
    (``engine/model.py``), and only where :func:`needed_here` says so. Its necessity on each
    checked version is probed like a CPU shim's (``tests/engine/test_compat.py``)."""

    name: str
    upstream: str
    """The upstream function or call site it covers."""
    needed: NeededOn


WORKAROUNDS: list[Workaround] = []
"""Every registered workaround, in registration order."""


def upstream_workaround(
    name: str, upstream: str, needed: NeededOn | None = None
) -> Callable[[Callable], Callable]:
    """Register the function of a workaround, needed on ``needed`` (default: every supported
    version so far); its docstring gains the upstream place and those versions."""
    needed = needed or NeededOn()

    def register(function: Callable) -> Callable:
        function.__doc__ = (
            f"{(function.__doc__ or '').strip()}\n\nCovers: {upstream}.\n"
            f"Needed on megatron-core {needed} (checked on {', '.join(CHECKED_VERSIONS)})."
        )
        WORKAROUNDS.append(Workaround(name, upstream, needed))
        return function

    return register
