import pytest

from kvlessons.memory import format_bytes


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (131072, "128 KiB"), (2**30, "1 GiB"), (8 * 2**30, "8 GiB"), (512 * 2**20, "512 MiB")],
)
def test_format_bytes_binary_units(n, text):
    """Bytes print in binary units with the unit named (the seed's 128 KiB, 1 GiB, 512 MiB)."""
    assert format_bytes(n) == text


@pytest.mark.parametrize("bad", [-1, 1.5, "12"])
def test_format_bytes_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="n must"):
        format_bytes(bad)
