"""The customer's money API: estimates with their price, balances and statements, a job's charges."""
from django.conf import settings
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.permissions import IsCustomer
from jobs import selectors as job_selectors
from jobs import services as job_services
from jobs.api import parse_choice
from jobs.hu import hu_str

from . import money, selectors


def _money(nanos: int) -> dict:
    currency = settings.MUNINN_CURRENCY
    return {"nanos": nanos, "currency": currency, "display": money.format_money(nanos, currency)}


class EstimateView(APIView):
    """What a job would cost, before anything is created: FLOPs, HU, price, peak memory."""

    permission_classes = [IsCustomer]

    def post(self, request):
        choice = parse_choice(request)
        dataset = job_selectors.dataset_get(owner=request.user, dataset_id=choice["dataset"])
        plan = job_services.job_plan(dataset=dataset, template=choice["template"], hparams=choice["hparams"],
                                     rounds=choice["rounds"])
        est = plan.estimate
        price = money.price_for_flops(est.flops_total, settings.MUNINN_PRICE_PER_HU, round_up=True)
        return Response({
            "template": choice["template"], "hparams": plan.hparams, "rounds": choice["rounds"],
            "flops": est.flops_total, "flops_per_round": est.flops_per_round, "hu": hu_str(est.hu),
            "price": _money(price), "price_per_hu": str(settings.MUNINN_PRICE_PER_HU),
            "peak_memory_bytes": est.peak_memory_bytes,
        })


class BalanceView(APIView):
    def get(self, request):
        balances = selectors.balances_for(user=request.user)
        statement = [
            {"id": e.pk, "at": e.transaction.created_at, "account": e.account.kind, "kind": e.transaction.kind,
             "amount": _money(e.amount), "memo": e.transaction.memo, "job": e.transaction.job_id,
             "unit": e.transaction.unit_id}
            for e in selectors.statement_for(user=request.user)[:200]
        ]
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
