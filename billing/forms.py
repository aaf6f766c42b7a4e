from decimal import Decimal

from django import forms
from django.conf import settings


class AmountForm(forms.Form):
    """An amount in the currency (e.g. 20.00), for top-ups and payout requests; the services check the limits."""

    amount = forms.DecimalField(max_digits=14, decimal_places=2, min_value=Decimal("0.01"),
                                error_messages={"required": "Enter an amount.",
                                                "invalid": "Enter an amount such as 20.00.",
                                                "max_decimal_places": "Enter whole cents (at most 2 decimals)."})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["amount"].widget.attrs.update({"step": "0.01", "min": "0.01"})
        self.fields["amount"].label = f"Amount ({settings.MUNINN_CURRENCY})"
