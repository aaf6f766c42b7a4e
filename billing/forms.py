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


class CreditForm(forms.Form):
    """Staff credit a customer's balance by hand (/staff/credits/): who, how much, and why (kept on record)."""

    customer = forms.CharField(max_length=150, label="Customer (username)",
                               error_messages={"required": "Enter the customer's username."})
    amount = forms.DecimalField(max_digits=14, decimal_places=2, min_value=Decimal("0.01"),
                                error_messages={"required": "Enter an amount.",
                                                "invalid": "Enter an amount such as 20.00.",
                                                "min_value": "Enter a positive amount (at least 0.01).",
                                                "max_decimal_places": "Enter whole cents (at most 2 decimals)."})
    reason = forms.CharField(max_length=500, label="Reason (kept on record and shown on the customer's statement)",
                             error_messages={"required": "Say why: the reason is kept with the credit."})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["amount"].label = f"Amount ({settings.MUNINN_CURRENCY})"
        self.fields["amount"].widget.attrs.update({"step": "0.01", "min": "0.01"})

    def clean_amount(self) -> Decimal:
        amount = self.cleaned_data["amount"]
        if amount > settings.MUNINN_CREDIT_MAX:
            raise forms.ValidationError(f"At most {settings.MUNINN_CREDIT_MAX} {settings.MUNINN_CURRENCY} in one "
                                        "credit (MUNINN_CREDIT_MAX).")
        return amount

    def clean_reason(self) -> str:
        reason = self.cleaned_data["reason"].strip()
        if not reason:
            raise forms.ValidationError("Say why: the reason is kept with the credit.")
        return reason
