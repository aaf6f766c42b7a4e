from django import forms
from django.contrib.auth.forms import UserCreationForm

from .models import User


class SignupForm(UserCreationForm):
    """Sign up as a customer (buy training) or a contributor (sell compute). Staff accounts are made by staff."""

    email = forms.EmailField(required=True, help_text="For password resets and receipts.")
    role = forms.ChoiceField(choices=[(User.Role.CUSTOMER, "Customer: train models on my data"),
                                      (User.Role.CONTRIBUTOR, "Contributor: earn money with my hardware")],
                             widget=forms.RadioSelect, initial=User.Role.CUSTOMER)

    class Meta(UserCreationForm.Meta):
        model = User
        fields = ("username", "email", "role")
