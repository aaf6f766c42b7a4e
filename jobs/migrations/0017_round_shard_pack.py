from django.db import migrations, models


class Migration(migrations.Migration):
    """A round's shards in one blob (Round.shards_sha256), each unit's at its offset. Rounds opened before keep a
    blob per shard: their units' offsets stay null."""

    dependencies = [
        ('jobs', '0016_result_lookups'),
    ]

    operations = [
        migrations.AddField(
            model_name='round',
            name='shards_sha256',
            field=models.CharField(blank=True, max_length=64),
        ),
        migrations.AddField(
            model_name='workunit',
            name='shard_offset',
            field=models.PositiveBigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='workunit',
            name='shard_size',
            field=models.PositiveBigIntegerField(blank=True, null=True),
        ),
    ]
