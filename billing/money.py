"""Money and HU arithmetic: pure functions over integers and Decimals, no Django.

Ledger amounts are integers in nano-units of the currency (10^-9 €, as in Google's Money type): a small
training job costs far less than a cent, and rounding it to cents would make the work free.
"""
from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

from jobs.hu import FLOPS_PER_HU, flops_to_hu  # noqa: F401  (re-exported: money and HU go together)
from muninn import figures
from muninn.figures import CENT, CURRENCY_SYMBOLS, NANOS_PER_UNIT  # noqa: F401  (one definition, shown there)


def price_for_flops(flops: int, price_per_hu: Decimal, *, round_up: bool) -> int:
    """The price of `flops` of training in nanos. Quotes round up and unit charges round down, so the
    charges of a job's units can never add up to more than its quote."""
    if flops < 0:
        raise ValueError("flops must not be negative")
    exact = Decimal(flops) * price_per_hu * NANOS_PER_UNIT / FLOPS_PER_HU
    return int(exact.to_integral_value(rounding=ROUND_CEILING if round_up else ROUND_FLOOR))


def quote_price(flops: int, price_per_hu: Decimal, *, minimum: int) -> int:
    """A job's quoted price in nanos, the most it can cost (its hold): its FLOPs at the rate, rounded up, and never
    below the minimum charge per job (settings.MUNINN_MIN_CHARGE_PER_JOB)."""
    return max(price_for_flops(flops, price_per_hu, round_up=True), minimum)


def minimum_top_up(*, minimum: int, charged: int, held: int) -> int:
    """What a job that succeeded pays the platform at its end so that it pays at least the minimum charge per job:
    the minimum less what its verified work was charged, never below zero, never more than is left of its hold
    (`held`). The work's charges, and so its contributors' earnings, are the same with or without it."""
    if minimum < 0 or charged < 0 or held < 0:
        raise ValueError("amounts must not be negative")
    return min(max(0, minimum - charged), held)


def price_share(price: int, quoted_flops: int, flops: int) -> int:
    """The part of a job's quoted `price` that `flops` of its verified work pays, in proportion to the FLOPs the
    quote counted, rounded down, and never more than the price (work beyond the estimate is not the customer's)."""
    if price < 0 or flops < 0:
        raise ValueError("price and flops must not be negative")
    if quoted_flops <= 0:
        return price if flops > 0 else 0
    return min(price, price * flops // quoted_flops)


def step_share(price: int, quoted_flops: int, flops_before: int, flops: int) -> int:
    """One unit's charge: the step in the job's cumulative share of its price after `flops_before` already
    charged, so remainders carry over between units and the charges add up to exactly the quoted price when the
    job does all its quoted work."""
    return price_share(price, quoted_flops, flops_before + flops) - price_share(price, quoted_flops, flops_before)


def split_charge(amount: int, contributor_share: Decimal) -> tuple[int, int]:
    """(contributor, platform) parts of a charge. The platform's fee rounds down: rounding favours the
    person who did the work."""
    if amount < 0:
        raise ValueError("amount must not be negative")
    fee = int((Decimal(amount) * (1 - contributor_share)).to_integral_value(rounding=ROUND_FLOOR))
    return amount - fee, fee


def to_nanos(amount: Decimal | str | int) -> int:
    value = Decimal(str(amount)) * NANOS_PER_UNIT
    if value != value.to_integral_value():
        raise ValueError(f"{amount} has more precision than a nano-unit")
    return int(value)


def format_money(nanos: int, currency: str = "EUR", *, exact: bool = False) -> str:
    """The one way money is shown (muninn.figures): to the cent, a non-zero amount under a cent as "< €0.01";
    `exact=True` shows every digit (up to 9 decimals, at least 2), for statements, memos and messages that compare
    two amounts."""
    return figures.money_exact(nanos, currency) if exact else figures.money_text(nanos, currency)


MINOR_DIGITS = {"JPY": 0, "KRW": 0}  # Stripe's "zero-decimal" currencies; the rest have cents


def nanos_per_minor(currency: str) -> int:
    """How many nanos make one of the currency's minor units (a cent), the unit Stripe counts in."""
    return 10 ** (9 - MINOR_DIGITS.get(currency.upper(), 2))


def to_minor(nanos: int, currency: str) -> int:
    """Nanos as Stripe's minor units; the amount must be whole minor units."""
    minor, rest = divmod(nanos, nanos_per_minor(currency))
    if rest:
        raise ValueError(f"{nanos} nanos is not a whole number of {currency} minor units")
    return minor


def from_minor(minor: int, currency: str) -> int:
    return minor * nanos_per_minor(currency)
