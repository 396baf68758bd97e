"""One migration per drain schema version (drain.postgres.django.schema says why)."""
