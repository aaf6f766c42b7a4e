"""The front page: the platform at a glance. The full web UI comes with its own issue."""
from django.db import connection
from django.http import JsonResponse
from django.shortcuts import render


def home(request):
    from contributors.selectors import devices_online
    from jobs.models import Job

    context = {
        "devices_online": devices_online().select_related("owner"),
        "jobs": Job.objects.select_related("owner").order_by("-created_at")[:10],
    }
    return render(request, "home.html", context)


def healthz(request):
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"ok": True})
