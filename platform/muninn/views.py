"""The front page: the platform at a glance. It is public, so it shows figures that name no one; a signed-in
customer also sees their own recent jobs (never anyone else's). And the site's public signing key."""
from django.db import connection
from django.http import JsonResponse
from django.shortcuts import render
from django.views import defaults
from django.views.decorators.http import require_safe

from . import site_key
from .errors import error_body


def home(request):
    from contributors.selectors import devices_online
    from jobs import selectors as job_selectors

    user = request.user
    context = {
        "totals": {**job_selectors.job_totals(), "devices_online": devices_online().count()},
        "jobs": job_selectors.recent_jobs_for(owner=user) if user.is_authenticated and user.is_customer else None,
    }
    return render(request, "home.html", context)


def healthz(request):
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"ok": True})


@require_safe
def signing_key(request):
    """/.well-known/muninn-signing-key: the public key that verifies the site's training certificates. Public and
    cacheable; anyone may fetch it, from anywhere."""
    response = JsonResponse({"algorithm": site_key.ALGORITHM, "key": site_key.public_key(),
                             "signs": "training certificates: GET /api/jobs/<id>/certificate"})
    response["Cache-Control"] = "public, max-age=3600"
    response["Access-Control-Allow-Origin"] = "*"
    return response


def not_found(request, exception=None):
    """404: the API's one error shape for a URL under /api/ that names no endpoint (a client parses JSON, never a
    page), the site's own page for everything else."""
    if request.path.startswith("/api/"):
        return JsonResponse(error_body("not_found", f"There is no API endpoint at {request.path}. The API's "
                                       "operations are listed at /api/schema."), status=404)
    return defaults.page_not_found(request, exception)
