"""The money API: estimates and quotes, balances and statements, a job's charges, top-ups, Stripe's webhook,
and contributors' payouts. Thin views over billing's services and selectors."""
from django.conf import settings
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.permissions import IsContributor, IsCustomer
from jobs import selectors as job_selectors
from jobs import services as job_services
from jobs.api import TRAINING_FIELDS, JobDetailSerializer, parse_choice, training_choice
from jobs.hu import hu_str

from . import money, payments, payouts, selectors, services, stripe_gateway
from .models import Payout, Quote


def _money(nanos: int) -> dict:
    currency = settings.MUNINN_CURRENCY
    return {"nanos": nanos, "currency": currency, "display": money.format_money(nanos, currency),
            "exact": money.format_money(nanos, currency, exact=True)}


def _base_weights(request, choice: dict):
    """The customer's base model for a LoRA job, looked up through their own datasets."""
    if choice.get("base_weights") is None:
        return None
    return job_selectors.dataset_get(owner=request.user, dataset_id=choice["base_weights"])


class EstimateView(APIView):
    """What a job would cost, before anything is created: FLOPs, HU, price, peak memory."""

    permission_classes = [IsCustomer]

    def post(self, request):
        choice = parse_choice(request)
        dataset = job_selectors.dataset_get(owner=request.user, dataset_id=choice["dataset"])
        plan = job_services.job_plan(dataset=dataset, template=choice["template"], hparams=choice["hparams"],
                                     rounds=choice["rounds"], base_weights=_base_weights(request, choice),
                                     training=training_choice(choice))
        est = plan.estimate
        price = money.quote_price(est.flops_total, settings.MUNINN_PRICE_PER_HU,
                                  minimum=money.to_nanos(settings.MUNINN_MIN_CHARGE_PER_JOB))
        return Response({
            "template": choice["template"], "hparams": plan.hparams, "rounds": choice["rounds"],
            **plan.scheme.fields(), "flops": est.flops_total, "flops_per_round": est.flops_per_round,
            "hu": hu_str(est.hu),
            "price": _money(price), "price_per_hu": str(settings.MUNINN_PRICE_PER_HU),
            "peak_memory_bytes": est.peak_memory_bytes,
        })


def quote_body(quote: Quote) -> dict:
    return {
        "id": str(quote.pk), "expires_at": quote.expires_at, "dataset": quote.dataset_id, "template": quote.template,
        "hparams": quote.hparams, "rounds": quote.rounds, "aggregation": quote.aggregation,
        **{name: getattr(quote, name) for name in TRAINING_FIELDS}, "flops": quote.flops,
        "hu": hu_str(money.flops_to_hu(quote.flops)), "price": _money(quote.price),
        "price_per_hu": str(quote.price_per_hu), "peak_memory_bytes": quote.peak_memory_bytes,
        "device_tier": selectors.quote_tier(quote),
        "devices_online": quote.devices_online, "devices_recent": quote.devices_recent,
        "expected_seconds": quote.expected_seconds,
        "job": quote.job_id, "accepted_at": quote.accepted_at,
    }


class QuoteListView(APIView):
    """A binding quote: HU, price, device tier and expected wall time. Accepting it starts the job."""

    permission_classes = [IsCustomer]
    online_capacity = None  # wired in muninn/urls.py: contributors/ knows the devices online
    recent_capable = None  # and the capable devices seen lately

    def get(self, request):
        return Response([quote_body(q) for q in selectors.quotes_for(customer=request.user)[:100]])

    def post(self, request):
        choice = parse_choice(request)
        dataset = job_selectors.dataset_get(owner=request.user, dataset_id=choice["dataset"])
        quote = services.quote_issue(customer=request.user, dataset=dataset, template=choice["template"],
                                     hparams=choice["hparams"], rounds=choice["rounds"],
                                     base_weights=_base_weights(request, choice), aggregation=choice["aggregation"],
                                     training=training_choice(choice), online_capacity=self.online_capacity,
                                     recent_capable=self.recent_capable)
        return Response(quote_body(quote), status=201)


class QuoteDetailView(APIView):
    permission_classes = [IsCustomer]

    def get(self, request, quote_id):
        return Response(quote_body(selectors.quote_get(customer=request.user, quote_id=quote_id)))


class QuoteAcceptView(APIView):
    permission_classes = [IsCustomer]

    def post(self, request, quote_id):
        job = services.quote_accept(customer=request.user, quote_id=quote_id)
        return Response(JobDetailSerializer(job).data, status=201)


class BalanceView(APIView):
    def get(self, request):
        balances = selectors.balances_for(user=request.user)
        statement = []
        for e in selectors.statement_for(user=request.user)[:200]:
            txn = e.transaction
            statement.append({
                "id": e.pk, "at": txn.created_at, "account": e.account.kind, "kind": txn.kind,
                "amount": _money(e.amount), "memo": txn.memo, "job": txn.job_id,
                "round": txn.unit.round.number if txn.unit_id else None, "unit": txn.unit_id,
                "payout": txn.payout_id})
        return Response({"balances": {k: _money(v) for k, v in balances.items()}, "statement": statement})


class JobChargesView(APIView):
    permission_classes = [IsCustomer]

    def get(self, request, job_id: int):
        job = job_selectors.job_get(owner=request.user, job_id=job_id)
        m = selectors.job_money(job=job)
        return Response({"job": job.pk, "quoted": _money(m["quoted"]), "charged": _money(m["charged"]),
                         "released": _money(m["released"]), "held": _money(m["held"]),
                         "hu_estimated": hu_str(job.hu_estimated),
                         "hu_charged": hu_str(money.flops_to_hu(m["flops_charged"]))})


class AmountSerializer(serializers.Serializer):
    amount = serializers.DecimalField(max_digits=14, decimal_places=2, min_value=0)  # in the currency, e.g. "20.00"


class TopUpView(APIView):
    """Start a Stripe Checkout top-up; the balance is credited when Stripe tells us the payment succeeded."""

    permission_classes = [IsCustomer]

    def get(self, request):
        return Response({"enabled": stripe_gateway.is_configured(),
                         "minimum": str(settings.MUNINN_TOPUP_MIN), "maximum": str(settings.MUNINN_TOPUP_MAX)})

    def post(self, request):
        stripe_gateway.require_configured("Top-ups")
        data = AmountSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        topup = payments.topup_start(customer=request.user, amount=data.validated_data["amount"])
        return Response({"id": topup.pk, "amount": _money(topup.amount), "checkout_url": topup.checkout_url,
                         "status": topup.status}, status=201)


class StripeWebhookView(APIView):
    """Stripe's signed events. No session or token: the signature is the authentication."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    def post(self, request):
        event = payments.webhook_receive(payload=request.body,
                                         signature=request.META.get("HTTP_STRIPE_SIGNATURE", ""))
        return Response({"event": event.stripe_id, "status": event.status})


def payout_body(payout: Payout) -> dict:
    return {"id": payout.pk, "amount": _money(payout.amount), "status": payout.status,
            "requested_at": payout.requested_at, "reviewed_at": payout.reviewed_at,
            "reason": payout.review_reason if payout.status == Payout.Status.REJECTED else payout.failure,
            "stripe_transfer_id": payout.stripe_transfer_id}


class PayoutOnboardingView(APIView):
    permission_classes = [IsContributor]

    def post(self, request):
        return Response({"url": payouts.payout_account_onboard(contributor=request.user)}, status=201)


class PayoutListView(APIView):
    permission_classes = [IsContributor]

    def get(self, request):
        return Response([payout_body(p) for p in selectors.payouts_for(contributor=request.user)[:100]])

    def post(self, request):
        data = AmountSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        payout = payouts.payout_request(contributor=request.user,
                                        amount=money.to_nanos(data.validated_data["amount"]))
        return Response(payout_body(payout), status=201)
