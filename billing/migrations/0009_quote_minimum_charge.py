from django.db import migrations, models
from django.db.models import F


def work_price_was_the_price(apps, schema_editor):
    """Quotes made before the minimum charge was settled apart: their units shared the whole price, so they go on
    doing so (and have no minimum to settle)."""
    apps.get_model("billing", "Quote").objects.update(work_price=F("price"))


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0008_credit_audit'),
    ]

    operations = [
        migrations.AddField(
            model_name='quote',
            name='work_price',
            field=models.BigIntegerField(default=0),
            preserve_default=False,
        ),
        migrations.RunPython(work_price_was_the_price, migrations.RunPython.noop),
        migrations.AddField(
            model_name='quote',
            name='minimum_charge',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AlterField(
            model_name='transaction',
            name='kind',
            field=models.CharField(choices=[('grant', 'Manual credit'), ('topup', 'Top-up'), ('hold', 'Hold for a job'), ('charge', 'Charge for verified work'), ('release', 'Release of an unused hold'), ('clear', 'Earnings cleared'), ('earnings_hold', 'Earnings held for review'), ('earnings_release', 'Held earnings released after review'), ('forfeit', 'Earnings forfeited (work found fraudulent), refunded'), ('payout_request', 'Payout requested'), ('payout', 'Payout transferred'), ('payout_return', 'Payout returned (rejected, failed or reversed)'), ('minimum_charge', 'Minimum charge per job')], max_length=16),
        ),
    ]
