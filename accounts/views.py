"""Sign-up and the start page; login, logout and password reset are Django's own views (accounts/urls.py)."""
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from . import services
from .forms import SignupForm
from .pages import home_for


@require_http_methods(["GET", "POST"])
def signup(request):
    if request.user.is_authenticated:
        return redirect(home_for(request.user))
    form = SignupForm(request.POST if request.method == "POST" else None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        user = services.user_sign_up(username=data["username"], password=data["password1"], role=data["role"],
                                    email=data["email"])
        login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        return redirect(home_for(user))
    return render(request, "accounts/signup.html", {"form": form}, status=400 if form.errors else 200)


@login_required
def start(request):
    """Where login lands: each role's own first page."""
    return redirect(home_for(request.user))
