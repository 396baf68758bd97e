"""Settings: what a drain is told (``drain.settings.config.Settings``, the
``DRAIN_*`` options) and the URLs it is given, parsed and masked.

The lowest layer: it imports only ``drain.errors``, ``drain.limits`` and
``drain.version``. Every other layer may import it.
"""
