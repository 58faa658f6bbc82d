from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('queries', '0005_bulk_files'),
    ]

    operations = [
        migrations.AddField(
            model_name='bulkresult',
            name='state_updates',
            field=models.PositiveBigIntegerField(blank=True, help_text="rows written over the epoch's matrix when answered", null=True),
        ),
        migrations.AddField(
            model_name='bulkresult',
            name='state_digest',
            field=models.CharField(blank=True, help_text='their digest, 0x and 64 hex digits', max_length=66),
        ),
    ]
