from django.contrib.auth.models import AbstractUser
from django.db import models


class User(AbstractUser):
    """A person on the platform. One role each: customers buy training, contributors sell compute."""

    class Role(models.TextChoices):
        CUSTOMER = "customer", "Customer"
        CONTRIBUTOR = "contributor", "Contributor"
        STAFF = "staff", "Staff"

    role = models.CharField(max_length=16, choices=Role.choices, default=Role.CUSTOMER)

    @property
    def is_customer(self) -> bool:
        return self.role == self.Role.CUSTOMER

    @property
    def is_contributor(self) -> bool:
        return self.role == self.Role.CONTRIBUTOR
