"""Price and HU arithmetic: exact integers, quotes are ceilings over the sum of unit charges."""
from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from billing.money import format_money, price_for_flops, split_charge, step_price, to_nanos


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
    assert format_money(34) == "€0.000000034"
    assert format_money(-to_nanos("1")) == "-€1.00"


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


@given(st.lists(st.integers(min_value=0, max_value=10**12), min_size=1, max_size=60),
       st.decimals(min_value=Decimal("0.01"), max_value=Decimal("100"), places=2))
def test_cumulative_unit_prices_add_up_to_the_price_of_the_whole(unit_flops, price):
    charged, before = 0, 0
    for flops in unit_flops:
        step = step_price(before, flops, price)
        assert step >= 0
        charged += step
        before += flops
    assert charged == price_for_flops(sum(unit_flops), price, round_up=False)
    assert charged <= price_for_flops(sum(unit_flops), price, round_up=True) <= charged + 1
