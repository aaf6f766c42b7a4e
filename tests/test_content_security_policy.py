"""Every page carries the site's Content-Security-Policy: scripts, styles and images from the site only, nothing
inline, no framing, forms posted only to the site (or redirected on to Stripe's hosted pages). tests/test_browser.py
runs the pages under it in a real browser and fails on anything it refused."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.test import Client

from .conftest import _named, digits_npz

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent

POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; "
          "base-uri 'none'; frame-ancestors 'none'; form-action 'self' https://checkout.stripe.com "
          "https://connect.stripe.com")


def test_the_home_login_and_job_pages_carry_the_policy(customer, customer_api):
    dataset = customer_api.post("/api/datasets", {"file": _named(digits_npz(200), "digits.npz")}, format="multipart")
    job = customer_api.post("/api/jobs", {"dataset": dataset.json()["id"], "template": "mlp", "rounds": 1},
                            format="json")
    assert job.status_code == 201, job.content
    signed_in = Client()
    signed_in.force_login(customer)

    pages = {"home": Client().get("/"), "login": Client().get("/login/"),
             "job": signed_in.get(f"/jobs/{job.json()['id']}/")}

    for name, response in pages.items():
        assert response.status_code == 200 and response["Content-Type"].startswith("text/html"), name
        assert response["Content-Security-Policy"] == POLICY, name


def test_the_sites_error_pages_carry_the_policy_and_json_answers_do_not_need_it(settings):
    settings.DEBUG = False

    page = Client().get("/no-such-page/")
    api = Client().get("/api/no-such-endpoint")

    assert page.status_code == 404 and page["Content-Security-Policy"] == POLICY
    assert api.status_code == 404 and api["Content-Type"] == "application/json"
    assert "Content-Security-Policy" not in api


def test_djangos_debug_pages_go_without_the_policy(settings):
    settings.DEBUG = True  # its 404 and 500 pages style and script themselves inline

    page = Client().get("/no-such-page/")

    assert page.status_code == 404 and "Content-Security-Policy" not in page


def test_templates_and_scripts_keep_no_inline_styles():
    """style-src 'self' refuses style="..." attributes and <style> blocks, in a template or in markup a script
    builds; a page's layout is a class in static/muninn/site.css. (Inline scripts: tests/test_request_limits.py.)"""
    files = [*(ROOT / "templates").rglob("*.html"), *(ROOT / "static" / "muninn").glob("*.js")]
    offending = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in files
                 for m in re.finditer(r"<style\b|\sstyle\s*=", f.read_text())]

    assert len(files) > 20 and offending == []
