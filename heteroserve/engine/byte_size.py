"""Sizes in bytes as people write them: 256MiB, 4GiB, 512MB, 1.5GiB or a plain count."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def byte_size(value: str | int) -> int:
    """The number of bytes `value` names; a ValueError (argparse's "invalid value") for anything else."""
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(value)
    unit = match and _UNITS.get(match.group(2).lower())
    if unit is None:
        raise ValueError(f"{value!r} is not a size in bytes (e.g. 1073741824, 512MB, 256MiB, 1.5GiB)")
    return int(float(match.group(1)) * unit)
