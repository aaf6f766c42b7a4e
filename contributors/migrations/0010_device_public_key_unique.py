"""A public key signs for one device only, in the database too (device_register's check could race).

Before the constraint: should two devices hold one key (only a race could have done it), the first to register
keeps it; each later one is retired with its key blanked, as if its registration had been refused, and its owner
registers it again with a key of its own."""
from django.db import migrations, models


def retire_later_holders_of_a_taken_key(apps, schema_editor):
    Device = apps.get_model("contributors", "Device")
    taken = (Device.objects.exclude(public_key="").values("public_key")
             .annotate(holders=models.Count("id")).filter(holders__gt=1).values_list("public_key", flat=True))
    for key in list(taken):
        first = Device.objects.filter(public_key=key).order_by("id").values_list("id", flat=True).first()
        Device.objects.filter(public_key=key).exclude(id=first).update(public_key="", is_active=False)


class Migration(migrations.Migration):

    dependencies = [
        ('contributors', '0009_device_event_abandoned'),
    ]

    operations = [
        migrations.RunPython(retire_later_holders_of_a_taken_key, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name='device',
            constraint=models.UniqueConstraint(condition=models.Q(('public_key', ''), _negated=True),
                                               fields=('public_key',), name='device_public_key_unique'),
        ),
    ]
