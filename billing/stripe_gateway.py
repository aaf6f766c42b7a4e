"""The one module that talks to Stripe. A pinned API version, Stripe's errors mapped to ours, idempotency keys
made by the callers from our own rows (a top-up, a payout), and webhook signatures checked by the official
library. Everything else in Muninn calls these functions and never imports `stripe`."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import stripe
from django.conf import settings

from muninn.errors import InvalidInput, MuninnError

log = logging.getLogger(__name__)

# Pinned: Stripe changes response shapes between API versions; we read the ones of this version only.
API_VERSION = "2026-10-28.endive"


class PaymentsDisabled(MuninnError):
    code = "payments_disabled"
    status = 503


class PaymentProviderError(MuninnError):
    """Stripe refused or failed a request. `message` is safe to show; `detail` has Stripe's code."""

    code = "payment_provider_error"
    status = 502


class BadSignature(InvalidInput):
    code = "bad_signature"


def is_configured() -> bool:
    return bool(settings.STRIPE_SECRET_KEY)


def require_configured(what: str = "Top-ups") -> None:
    if not is_configured():
        raise PaymentsDisabled(
            f"{what} are disabled on this site: Stripe is not configured (STRIPE_SECRET_KEY is unset). "
            "Staff can credit a balance by hand in the admin.")


def _client() -> stripe.StripeClient:
    require_configured("Payments")
    return stripe.StripeClient(
        settings.STRIPE_SECRET_KEY, stripe_version=API_VERSION,
        base_addresses={"api": settings.STRIPE_API_BASE}, max_network_retries=2,
    )


def _call(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except stripe.StripeError as e:
        log.warning("stripe %s failed: %s", what, e)
        raise PaymentProviderError(
            f"Stripe could not {what}: {e.user_message or getattr(e, 'code', None) or 'request failed'}",
            detail={"stripe_code": getattr(e, "code", None), "http_status": getattr(e, "http_status", None)},
        ) from e


@dataclass(frozen=True)
class CheckoutSession:
    id: str
    url: str


def checkout_session_create(*, amount_minor: int, currency: str, customer_email: str, client_reference_id: str,
                            success_url: str, cancel_url: str, idempotency_key: str) -> CheckoutSession:
    session = _call("start the checkout", _client().v1.checkout.sessions.create, params={
        "mode": "payment",
        "client_reference_id": client_reference_id,
        "customer_email": customer_email or None,
        "line_items": [{"quantity": 1, "price_data": {
            "currency": currency.lower(), "unit_amount": amount_minor,
            "product_data": {"name": "Muninn balance top-up"}}}],
        "metadata": {"muninn_topup": client_reference_id},
        "success_url": success_url, "cancel_url": cancel_url,
    }, options={"idempotency_key": idempotency_key})
    return CheckoutSession(session.id, session.url)


def connect_account_create(*, email: str, idempotency_key: str) -> str:
    account = _call("create the payout account", _client().v1.accounts.create, params={
        "type": "express", "email": email or None,
        "capabilities": {"transfers": {"requested": True}},
    }, options={"idempotency_key": idempotency_key})
    return account.id


def account_link_create(*, account_id: str, refresh_url: str, return_url: str) -> str:
    link = _call("start onboarding", _client().v1.account_links.create, params={
        "account": account_id, "refresh_url": refresh_url, "return_url": return_url, "type": "account_onboarding",
    })
    return link.url


def transfer_create(*, amount_minor: int, currency: str, destination: str, idempotency_key: str,
                    metadata: dict[str, str]) -> str:
    transfer = _call("transfer the payout", _client().v1.transfers.create, params={
        "amount": amount_minor, "currency": currency.lower(), "destination": destination, "metadata": metadata,
    }, options={"idempotency_key": idempotency_key})
    return transfer.id


def webhook_event(*, payload: bytes, signature: str) -> dict:
    """The event, if the payload was signed with our webhook secret within the tolerance; else BadSignature."""
    if not settings.STRIPE_WEBHOOK_SECRET:
        raise PaymentsDisabled("Stripe webhooks are disabled on this site: STRIPE_WEBHOOK_SECRET is unset.")
    try:
        event = stripe.Webhook.construct_event(payload, signature, settings.STRIPE_WEBHOOK_SECRET,
                                               tolerance=settings.STRIPE_WEBHOOK_TOLERANCE_SECONDS)
    except stripe.SignatureVerificationError as e:
        raise BadSignature(f"The Stripe signature does not verify: {e.user_message or e}") from e
    except ValueError as e:
        raise InvalidInput("The webhook payload is not a Stripe event.", code="bad_payload") from e
    return event.to_dict(for_json=True)
