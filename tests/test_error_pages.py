"""The site's own 403, 404 and 500 pages, as users meet them with DEBUG off: styled like every page, saying what
happened and where to go (a 403 keeps the site's own sentence)."""
from __future__ import annotations

import pytest
from django.test import Client
from django.urls import include, path

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.test_error_pages")]


def broken_view(request):
    raise RuntimeError("a bug")


# This module is the URLconf of its tests: the site's URLs, plus one view that fails.
urlpatterns = [path("broken/", broken_view), path("", include("muninn.urls"))]


@pytest.fixture(autouse=True)
def debug_off(settings):
    settings.DEBUG = False


def signed_in(django_user_model, role: str) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_user(username=f"a-{role}", password="x", role=role))
    return client


def test_403_keeps_the_sites_message_and_points_to_the_users_own_pages(django_user_model):
    customer = signed_in(django_user_model, "customer")

    response = customer.get("/contribute/")

    page = response.content.decode()
    assert response.status_code == 403
    assert "This page is for contributor accounts." in page
    assert "site.css" in page  # the site's layout
    assert "a-customer</strong>, a customer account" in page and 'href="/jobs/"' in page


def test_404_says_nothing_is_there_and_where_to_go(django_user_model):
    contributor = signed_in(django_user_model, "contributor")

    response = contributor.get("/no/such/page/")

    page = response.content.decode()
    assert response.status_code == 404
    assert "There is nothing here" in page and "/no/such/page/" in page and 'href="/contribute/"' in page
    assert "site.css" in page and "urlpatterns" not in page.lower()  # not Django's debug page


def test_404_for_an_anonymous_visitor_points_to_the_front_page_and_the_login():
    response = Client().get("/no/such/page/")

    assert response.status_code == 404
    assert 'href="/login/"' in response.content.decode()


def test_500_is_the_sites_page_without_the_error_itself():
    response = Client(raise_request_exception=False).get("/broken/")

    page = response.content.decode()
    assert response.status_code == 500
    assert "Something went wrong on our side" in page and "site.css" in page and "a bug" not in page
