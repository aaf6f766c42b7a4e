"""Figures as people read them (muninn.figures): money to the cent with "< €0.01" for less, work in HU with an SI
prefix (FLOP below 1 mHU), the exact value in every rounded figure's title; and the page script's mirror
(Muninn.figures in static/muninn/common.js) agreeing with it, checked in chromium on the same examples."""
from __future__ import annotations

import random
import re
from decimal import Decimal
from pathlib import Path

import pytest
from django.template import Context, Template
from hypothesis import given
from hypothesis import strategies as st
from playwright import sync_api as playwright_sync  # in the dev extras, as for the browser tests

from jobs.hu import FLOPS_PER_HU
from muninn import figures

CENT = figures.CENT
COMMON_JS = Path(__file__).resolve().parent.parent / "static" / "muninn" / "common.js"


def test_money_reads_to_the_cent_with_the_exact_figure_on_hover():
    assert figures.money_text(36) == "< €0.01"  # not €0.000000036, and not a misleading €0.00
    assert figures.money_title(36) == "exactly €0.000000036"
    assert figures.money_text(0) == "€0.00"
    assert figures.money_text(CENT) == "€0.01"
    assert figures.money_text(120_000_000) == "€0.12"
    assert figures.money_text(99_999_999_817) == "€100.00"
    assert figures.money_text(1_234_567_890_123, "USD") == "$1,234.57"
    assert figures.money_text(-3) == "> -€0.01"
    assert figures.money_exact(500_000_000) == "€0.50"


def test_work_reads_in_hu_with_a_prefix_or_in_flop_below_a_milli_hu():
    assert figures.hu_text(512_434_176) == "512 MFLOP"  # 0.0000000512434176 HU
    assert figures.hu_title(512_434_176) == "exactly 0.0000000512434176 HU (512,434,176 FLOPs)"
    assert figures.hu_text(0) == "0 HU"
    assert figures.hu_text(7) == "7 FLOP"
    assert figures.hu_text(31 * 10**12) == "3.1 mHU"
    assert figures.hu_text(12_400_000_000_000_000) == "1.24 HU"
    assert figures.hu_text(FLOPS_PER_HU) == "1 HU"
    assert figures.hu_text(9_995 * 10**15) == "1 kHU"  # 999.5 HU rounds up into the next prefix
    assert figures.hu_text(9_994_999_999_999) == "9.99 TFLOP"
    assert figures.hu_text(9_995_000_000_000) == "1 mHU"


def _significant_digits(text: str) -> int:
    digits = re.sub(r"[^0-9]", "", text.split(" ")[0]).lstrip("0")
    return len(digits.rstrip("0")) if "." not in text else len(digits)


@given(st.integers(min_value=0, max_value=10**30), st.integers(min_value=1, max_value=6))
def test_work_never_shows_more_digits_than_asked_and_stays_close(flops, digits):
    text = figures.hu_text(flops, digits)
    assert _significant_digits(text) <= digits
    number, unit = text.split(" ")
    scale = {"mHU": FLOPS_PER_HU // 1000, "HU": FLOPS_PER_HU, "kHU": FLOPS_PER_HU * 10**3,
             "MHU": FLOPS_PER_HU * 10**6, "GHU": FLOPS_PER_HU * 10**9, "FLOP": 1, "kFLOP": 10**3,
             "MFLOP": 10**6, "GFLOP": 10**9, "TFLOP": 10**12}[unit]
    shown = Decimal(number.replace(",", "")) * scale
    assert abs(shown - flops) <= Decimal(flops) / 10 ** (digits - 1) / 2  # within half a unit of the last digit
    assert (shown == 0) == (flops == 0)  # no work is "0 HU" but none


@given(st.integers(min_value=-10**15, max_value=10**15))
def test_money_never_shows_more_than_cents_nor_nothing_for_something(nanos):
    text = figures.money_text(nanos)
    assert re.fullmatch(r"(-?€[0-9,]+\.[0-9]{2}|< €0\.01|> -€0\.01)", text), text
    if nanos and text.endswith("€0.00"):
        pytest.fail(f"{nanos} nanos shown as {text}")
    if "<" not in text and ">" not in text:
        assert abs(Decimal(text.replace("€", "").replace(",", "")) * 10**9 - nanos) <= CENT // 2
    assert Decimal(figures.money_exact(nanos).replace("€", "").replace(",", "")) * 10**9 == nanos


def test_the_filters_show_the_rounded_figure_with_the_exact_one_in_the_title(settings):
    settings.MUNINN_CURRENCY = "EUR"
    html = Template("{{ n|money }} / {{ f|hu }}").render(Context({"n": 36, "f": 512_434_176}))
    assert html == ('<span class="figure-value" title="exactly €0.000000036">&lt; €0.01</span> / '
                    '<span class="figure-value" title="exactly 0.0000000512434176 HU (512,434,176 FLOPs)">'
                    '512 MFLOP</span>')


def _examples() -> tuple[list[int], list[int]]:
    """Edges (around a cent, a milli-HU, a prefix's step, 2^53) and a seeded spread over every magnitude."""
    rng = random.Random(13)
    flops = [0, 1, 999, 1000, 1499, 1500, 2500, 512_434_176, 9_994_999_999_999, 9_995_000_000_000, 10**13,
             2**53, 2**53 + 1, 9_995 * 10**15, 10**26, 123_456_789 * 10**25]
    flops += [rng.randrange(10 ** rng.randrange(1, 30)) for _ in range(400)]
    nanos = [0, 1, 36, CENT - 1, CENT, CENT + CENT // 2, 25_000_000, 99_999_999_817, -3, -CENT, 2**53, -(2**53)]
    nanos += [rng.randrange(-10 ** rng.randrange(1, 16), 10 ** rng.randrange(1, 16)) for _ in range(400)]
    return flops, nanos


def test_the_page_script_formats_every_figure_as_the_server_does():
    flops, nanos = _examples()
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page()
        page.add_script_tag(content=COMMON_JS.read_text())
        shown = page.evaluate("""([flops, nanos]) => {
            const F = window.Muninn.figures;
            const back = (f) => F.huToFlops(F.huExact(f).split(" ")[0]).toString();  // the exact HU, read back
            return {hu: flops.map((f) => [F.hu(f).text, F.hu(f).title, back(f)]),
                    money: nanos.map((n) => [F.money(n, "EUR").text, F.money(n, "EUR").title])};
        }""", [[str(f) for f in flops], [str(n) for n in nanos]])
        browser.close()
    assert shown["hu"] == [[figures.hu_text(f), figures.hu_title(f), str(f)] for f in flops]
    assert shown["money"] == [[figures.money_text(n), figures.money_title(n)] for n in nanos]
