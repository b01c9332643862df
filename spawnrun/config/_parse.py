"""Validators of spawnrun's settings: each takes a value and where it came from, and
returns it parsed or raises a ``pytest.UsageError`` that names that source.

Runs in the parent. ``_settings`` builds its table of settings from these; the marker's
own arguments are checked with them too (``_plan``).
"""

from __future__ import annotations

import keyword
import math
import os
import re

import pytest

from spawnrun.devices import _packing

#: pytest-forked's marker: spawns as ``<marker>(count=0)`` while pytest-forked is absent.
FORKED = "forked"
#: Markers pytest itself gives a meaning; a spawn marker by one of these names would clash.
PYTEST_MARKERS = frozenset(
    ("skip", "skipif", "xfail", "parametrize", "usefixtures", "filterwarnings")
)
#: Timeouts from this many seconds on (about 3 years) mean no limit.
NO_LIMIT_FROM = 1e8


def parse_bool(value: object, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise pytest.UsageError(f"{source}: expected a boolean (true/false), got {value!r}")


def parse_bool_strict(value: object, source: str) -> bool:
    """A marker's flag: True or False, nothing that merely looks like one."""
    if not isinstance(value, bool):
        raise pytest.UsageError(f"{source}: expected True or False, got {value!r}")
    return value


def parse_timeout(value: object, source: str) -> float | None:
    """Seconds as a non-negative number; 0, "none" or None mean no limit."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise pytest.UsageError(f"{source}: expected seconds, got {value!r}")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "none", "0"):
            return None
        try:
            seconds = float(text)
        except ValueError:
            raise pytest.UsageError(
                f"{source}: expected seconds (a number, 0 or 'none'), got {value!r}"
            ) from None
    elif isinstance(value, (int, float)):
        seconds = float(value)
    else:
        raise pytest.UsageError(f"{source}: expected seconds, got {value!r}")
    if math.isnan(seconds) or seconds < 0:
        raise pytest.UsageError(f"{source}: seconds must be >= 0, got {value!r}")
    # 0 means no limit; so does a limit no run reaches (inf, 1e9: a deadline that far
    # would overflow the waits that use it).
    return None if seconds == 0 or seconds >= NO_LIMIT_FROM else seconds


def parse_jobs(value: object, source: str) -> int | None:
    """A positive number of children at once, or auto (None)."""
    if value is None or str(value).strip().lower() in ("", "auto"):
        return None
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise pytest.UsageError(f"{source}: expected a whole number >= 1 or auto, got {value!r}")
    return int(text)


def parse_method(value: object, source: str) -> str:
    text = str(value).strip().lower()
    if text not in ("spawn", "forkserver"):
        raise pytest.UsageError(f"{source}: expected spawn or forkserver, got {value!r}")
    return text


def parse_modules(value: object, source: str) -> tuple[str, ...]:
    """Module names separated by spaces, commas or lines."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    names = tuple(str(i).strip() for i in items if str(i).strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise pytest.UsageError(f"{source}: {name!r} is not a module name")
    return names


def parse_lookahead(value: object, source: str) -> int | None:
    """A whole number >= 0 of children booted ahead, or auto (None)."""
    if value is None or str(value).strip().lower() in ("", "auto"):
        return None
    text = str(value).strip()
    if not text.isdigit():
        raise pytest.UsageError(f"{source}: expected a whole number >= 0 or auto, got {value!r}")
    return int(text)


def default_lookahead(cpus: int | None = None, available_bytes: int | None = None) -> int:
    """One child booted ahead per two CPUs (at most 8), and at most one per 2 GiB free.

    Booting ahead only pays while a core is free to do it: on 2 cores one child
    ahead halves spawn overhead and a second does not help (shared measurements); on a
    16-core GPU host a spawn child's boot (5-6 s with torch and the image's plugins)
    needs several booting at once to keep up with short tests. A booted child that
    imported torch holds roughly 0.5-1 GiB of host memory.
    """
    cpus = cpus or usable_cpus()
    by_cpu = min(8, max(1, cpus // 2))
    if available_bytes is None:
        available_bytes = _available_memory()
    by_memory = max(0, available_bytes // (2 * 2**30)) if available_bytes else by_cpu
    return int(min(by_cpu, by_memory))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: ``taskset``, a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def parse_marker(value: object, source: str) -> str:
    """A marker name as ``@pytest.mark.<name>`` can spell it, not one of pytest's own."""
    text = str(value).strip()
    if not text.isidentifier() or keyword.iskeyword(text) or text.startswith("_"):
        raise pytest.UsageError(f"{source}: expected a marker name (an identifier), got {value!r}")
    if text in PYTEST_MARKERS:
        raise pytest.UsageError(f"{source}: {value!r} is one of pytest's own markers")
    return text


def parse_count(value: object, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise pytest.UsageError(f"{source}: expected a whole number >= 0, got {value!r}")
    return value


def parse_memory(value: object, source: str) -> int | None:
    """A test's memory budget per device (``_packing.parse_size``); none: no budget."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    return _packing.parse_size(value, source)


def parse_capacity(value: object, source: str) -> int | None:
    """Each device's memory where NVML cannot tell; auto: NVML's only."""
    if value is None or str(value).strip().lower() in ("", "auto"):
        return None
    return _packing.parse_size(value, source)


def parse_per_gpu(value: object, source: str) -> int | None:
    """A whole number >= 1 of tests at once on one device, or auto (None)."""
    return parse_jobs(value, source)


PACK_MODES = ("off", "declared", "auto")


def parse_pack(value: object, source: str) -> str:
    text = str(value).strip().lower()
    if text not in PACK_MODES:
        raise pytest.UsageError(f"{source}: expected off, declared or auto, got {value!r}")
    return text


SCOPES = ("test", "class", "module")


def parse_scope(value: object, source: str) -> str:
    text = str(value).strip().lower() if isinstance(value, str) else value
    if text not in SCOPES:
        raise pytest.UsageError(f"{source}: expected test, class or module, got {value!r}")
    return str(text)


def parse_group(value: object, source: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise pytest.UsageError(
            f"{source}: expected a group name (a non-empty string), got {value!r}"
        )
    return value.strip()


def parse_poison(value: object, source: str) -> tuple[str, ...]:
    """Regular expressions, one per line (``$`` ends a line): failures after which a
    scope's child is replaced."""
    lines = value if isinstance(value, list) else str(value).splitlines()
    patterns = tuple(str(line).strip() for line in lines if str(line).strip())
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise pytest.UsageError(
                f"{source}: {pattern!r} is not a regular expression ({exc})"
            ) from None
    return patterns


def parse_template(value: object, source: str) -> str:
    text = str(value).strip().lower()
    if text not in ("file", "run", "library"):
        raise pytest.UsageError(f"{source}: expected file, run or library, got {value!r}")
    return text


def parse_pycache(value: object, source: str) -> str:
    text = str(value).strip().lower()
    if text not in ("auto", "off"):
        raise pytest.UsageError(f"{source}: expected auto or off, got {value!r}")
    return text


def parse_confirm(value: object, source: str) -> str:
    text = str(value).strip().lower()
    if text not in ("rerun", "strict"):
        raise pytest.UsageError(f"{source}: expected rerun or strict, got {value!r}")
    return text


def parse_jax_cache(value: object, source: str) -> str:
    text = str(value).strip().lower()
    if text not in ("auto", "run", "off"):
        raise pytest.UsageError(f"{source}: expected auto, run or off, got {value!r}")
    return text
