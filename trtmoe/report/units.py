"""Human-readable sizes and counts for tables."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """Binary units: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def fmt_count(n: int) -> str:
    """Decimal suffixes: 3_871_872 -> '3.87M'."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)
