from rest_framework.permissions import BasePermission


class IsCustomer(BasePermission):
    message = "Only customer accounts can do this."

    def has_permission(self, request, view) -> bool:
        return bool(request.user and request.user.is_authenticated and request.user.role == "customer")


class IsContributor(BasePermission):
    message = "Only contributor accounts can register devices."

    def has_permission(self, request, view) -> bool:
        return bool(request.user and request.user.is_authenticated and request.user.role == "contributor")
