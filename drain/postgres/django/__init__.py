"""drain's schema through Django's ``manage.py migrate`` (docs/migration_tools.md).

Add ``"drain.postgres.django"`` to ``INSTALLED_APPS``: its migrations (app label
``drain``) apply the staging schema exactly as ``drain migrate`` does. Django is
optional: nothing outside this package imports it.
"""
