"""The Django app of drain's schema: ``INSTALLED_APPS = [..., "drain.postgres.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class DrainConfig(AppConfig):  # type: ignore[misc]  # Django has no type hints here
    """drain's schema as Django migrations (drain.postgres.django.schema). The label is
    ``drain``: ``manage.py migrate drain``, ``showmigrations drain``."""

    name = "drain.postgres.django"
    label = "drain"
    verbose_name = "drain (staged Celery jobs)"
    default_auto_field = "django.db.models.BigAutoField"
