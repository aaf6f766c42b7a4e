"""Figures as people read them: money to the cent and HU with an SI prefix, each with its exact value for a tooltip.
Pure functions over integers (nano-units of the currency, FLOPs), no Django. static/muninn/common.js mirrors
them (Muninn.formatMoney, Muninn.formatHu); tests/test_figures.py keeps the two agreeing.

Where figures are exact: the API (every amount's `exact` and `nanos`, HU as plain decimal strings), the statement,
and the title attribute of every rounded figure on a page."""
from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Context, Decimal

from jobs.hu import FLOPS_PER_HU

NANOS_PER_UNIT = 10**9  # ledger amounts are integers in 10^-9 of the currency
CENT = NANOS_PER_UNIT // 100
CURRENCY_SYMBOLS = {"EUR": "€", "USD": "$", "GBP": "£"}

HU_DIGITS = 3  # significant digits of a rounded HU figure
# The prefixes a rounded HU figure may take, by power of ten. Below 1 mHU (10 TFLOP) HU read badly ("51.2 nHU"),
# so smaller work is shown in FLOP, as people who know compute count it.
HU_PREFIXES = {-3: "m", 0: "", 3: "k", 6: "M", 9: "G"}
FLOP_PREFIXES = {0: "", 3: "k", 6: "M", 9: "G", 12: "T"}
SMALLEST_HU_SHOWN = FLOPS_PER_HU // 1000  # 1 mHU in FLOPs


def _symbol(currency: str) -> str:
    return CURRENCY_SYMBOLS.get(currency, currency + " ")


def money_exact(nanos: int, currency: str = "EUR") -> str:
    """Every digit of the amount, at least two decimals: €0.000000036, €100.00, -€1.230000001."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), NANOS_PER_UNIT)
    digits = f"{frac:09d}".rstrip("0").ljust(2, "0")
    return f"{sign}{_symbol(currency)}{whole:,}.{digits}"


def money_text(nanos: int, currency: str = "EUR") -> str:
    """The amount to the cent (half to even): €0.12, €1,234.57. A non-zero amount under a cent reads "< €0.01"
    ("> -€0.01" below zero), never "€0.00"."""
    if 0 < abs(nanos) < CENT:
        return f"< {_symbol(currency)}0.01" if nanos > 0 else f"> -{_symbol(currency)}0.01"
    cents = int((Decimal(abs(nanos)) / CENT).to_integral_value(rounding=ROUND_HALF_EVEN))
    return money_exact(cents * CENT if nanos >= 0 else -cents * CENT, currency)


def money_title(nanos: int, currency: str = "EUR") -> str:
    return f"exactly {money_exact(nanos, currency)}"


def _significant(value: int, digits: int) -> Decimal:
    """A positive integer rounded to `digits` significant digits (half to even)."""
    return Context(prec=digits, rounding=ROUND_HALF_EVEN).plus(Decimal(value))


def _with_prefix(rounded: Decimal, shift: int, prefixes: dict[int, str], unit: str) -> str:
    """`rounded` × 10^shift shown with the largest prefix at or below it: 1.24 HU, 3.1 mHU, 512 MFLOP."""
    exponent = rounded.adjusted() + shift
    power = max(p for p in prefixes if p <= exponent) if exponent >= min(prefixes) else min(prefixes)
    mantissa = rounded.scaleb(shift - power).normalize()
    # Whole mantissas get thousands separators (above the largest prefix they grow: 12,000 GHU); others are below 1000.
    text = f"{int(mantissa):,}" if mantissa == mantissa.to_integral_value() else format(mantissa, "f")
    return f"{text} {prefixes[power]}{unit}"


def hu_text(flops: int, digits: int = HU_DIGITS) -> str:
    """Work rounded to `digits` significant digits: in HU with an SI prefix from 1 mHU up (1.24 HU, 3.1 mHU,
    12 kHU), in FLOP below (512 MFLOP, 7 FLOP), trailing zeros dropped; nothing is "0 HU" but no work."""
    if flops < 0:
        raise ValueError("work is never negative")
    if flops == 0:
        return "0 HU"
    rounded = _significant(flops, digits)
    if rounded >= SMALLEST_HU_SHOWN:
        return _with_prefix(rounded, -16, HU_PREFIXES, "HU")
    return _with_prefix(rounded, 0, FLOP_PREFIXES, "FLOP")


def hu_exact(flops: int) -> str:
    """The exact HU and FLOPs: "0.0000000512434176 HU (512,434,176 FLOPs)"."""
    whole, frac = divmod(flops, FLOPS_PER_HU)  # integers: exact at any size, as jobs.hu.hu_str is up to 10^12 HU
    hu = f"{whole}.{frac:016d}".rstrip("0").rstrip(".")
    return f"{hu} HU ({flops:,} FLOP{'' if flops == 1 else 's'})"


def hu_title(flops: int) -> str:
    return f"exactly {hu_exact(flops)}"
