"""Hardware units: 1 HU = 10^16 FLOPs of training compute. Pure arithmetic, shared by jobs/ and billing/."""
from decimal import Decimal

FLOPS_PER_HU = 10**16


def flops_to_hu(flops: int) -> Decimal:
    return Decimal(flops) / Decimal(FLOPS_PER_HU)


def hu_str(hu: Decimal) -> str:
    """HU as a plain decimal string (never scientific notation): exact, since 1 FLOP = 10^-16 HU."""
    return format(hu, "f")
