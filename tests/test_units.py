import pytest

from autotune.errors import UsageError
from autotune.units import format_bytes, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [("24GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("8gb", 8 * 10**9),
     ("100", 100), ("2 KiB", 2048), ("1e6", 10**6), (4096, 4096)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "0", "0MiB", "1..2"])
def test_parse_size_rejects_bad_sizes_with_a_hint(text):
    with pytest.raises(UsageError, match="size"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(None) == "-"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30 // 2) == "1.50 GiB"
