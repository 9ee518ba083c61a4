"""--kv-cache-memory-bytes' sizes: decimal and binary units, fractions, plain counts; anything else refused."""

from __future__ import annotations

import pytest

from heteroserve.engine.byte_size import byte_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1073741824", 2**30),
        ("256MiB", 256 * 2**20),
        ("4GiB", 4 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("64 kib", 64 * 2**10),
        (2048, 2048),
    ],
)
def test_sizes_people_write(text, size):
    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["", "4XB", "GiB", "-1", "1e9", "4 GiB B"])
def test_anything_else_is_a_value_error(text):
    with pytest.raises(ValueError, match="not a size in bytes"):
        byte_size(text)
