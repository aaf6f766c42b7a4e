"""Price and HU arithmetic: exact integers, quotes are ceilings over the sum of unit charges."""
from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from billing.money import (format_money, minimum_top_up, price_for_flops, price_share, quote_price, split_charge,
                           step_share, to_nanos)


def test_one_hu_costs_the_price_per_hu():
    assert price_for_flops(10**16, Decimal("0.21"), round_up=False) == 210_000_000


def test_quote_rounds_up_and_charge_rounds_down():
    assert price_for_flops(1, Decimal("0.21"), round_up=True) == 1
    assert price_for_flops(1, Decimal("0.21"), round_up=False) == 0


def test_split_gives_the_rounding_to_the_contributor():
    assert split_charge(1, Decimal("0.70")) == (1, 0)
    assert split_charge(100, Decimal("0.70")) == (70, 30)


def test_format_money():
    assert format_money(to_nanos("12.5")) == "€12.50"
    assert format_money(34) == "< €0.01"
    assert format_money(34, exact=True) == "€0.000000034"
    assert format_money(-to_nanos("1")) == "-€1.00"


def test_amounts_are_shown_to_the_cent_and_exactly_when_asked():
    assert format_money(99_999_999_817) == "€100.00"  # a balance after a few tiny jobs
    assert format_money(99_999_999_817, exact=True) == "€99.999999817"
    assert format_money(1_234_567_890_123) == "€1,234.57"
    assert format_money(to_nanos("0.015")) == "€0.02"
    assert format_money(23_300) == "< €0.01"  # one unit's earnings: never shown as nothing
    assert format_money(23_300, exact=True) == "€0.0000233"
    assert format_money(-99_999_999_817) == "-€100.00"


def test_a_job_is_never_quoted_below_the_minimum_charge():
    assert quote_price(10**9, Decimal("0.21"), minimum=to_nanos("0.01")) == to_nanos("0.01")
    assert quote_price(10**16, Decimal("0.21"), minimum=to_nanos("0.01")) == to_nanos("0.21")


def test_a_units_share_of_the_price_follows_its_flops_and_never_exceeds_the_price():
    assert price_share(to_nanos("0.01"), 300, 100) == 3_333_333
    assert price_share(to_nanos("0.01"), 300, 300) == to_nanos("0.01")
    assert price_share(to_nanos("0.01"), 300, 600) == to_nanos("0.01")  # work beyond the estimate is free


@given(st.lists(st.integers(min_value=0, max_value=10**18), min_size=1, max_size=50),
       st.decimals(min_value=Decimal("0.01"), max_value=Decimal("100"), places=2))
def test_unit_charges_never_add_up_to_more_than_the_quote(unit_flops, price):
    quote = price_for_flops(sum(unit_flops), price, round_up=True)
    charges = [price_for_flops(f, price, round_up=False) for f in unit_flops]
    assert sum(charges) <= quote


@given(st.integers(min_value=0, max_value=10**15), st.decimals(min_value=0, max_value=1, places=2))
def test_split_is_exact_and_never_negative(amount, share):
    to_contributor, fee = split_charge(amount, share)
    assert to_contributor + fee == amount and to_contributor >= 0 and fee >= 0


@given(st.lists(st.integers(min_value=1, max_value=10**12), min_size=1, max_size=60),
       st.integers(min_value=to_nanos("0.01"), max_value=10**13))
def test_unit_shares_add_up_to_exactly_the_quote_when_the_job_does_its_quoted_work(unit_flops, price):
    quoted, charged, before = sum(unit_flops), 0, 0
    for flops in unit_flops:
        step = step_share(price, quoted, before, flops)
        assert step >= 0
        charged += step
        before += flops
        assert charged == price_share(price, quoted, before) <= price
    assert charged == price


def test_a_job_that_succeeded_below_the_minimum_pays_the_difference_and_no_more():
    assert minimum_top_up(minimum=to_nanos("0.50"), charged=36, held=to_nanos("0.50") - 36) == to_nanos("0.50") - 36
    assert minimum_top_up(minimum=to_nanos("0.50"), charged=to_nanos("3"), held=to_nanos("1")) == 0
    assert minimum_top_up(minimum=0, charged=0, held=to_nanos("1")) == 0


@given(st.integers(min_value=0, max_value=10**13), st.integers(min_value=0, max_value=10**13),
       st.integers(min_value=0, max_value=10**13))
def test_the_minimum_charge_never_takes_more_than_quoted_or_the_minimum(work_price, minimum, charged_part):
    price = max(work_price, minimum)  # the quote, and the hold
    charged = min(charged_part, work_price)  # the units' charges never pass the work's price
    top_up = minimum_top_up(minimum=minimum, charged=charged, held=price - charged)
    assert 0 <= top_up <= price - charged
    assert charged + top_up == max(charged, minimum) <= price  # at least the minimum, never more than quoted
