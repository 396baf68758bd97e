"""The ``drain`` command: ``drain.cli.main`` builds the parser and runs a
command; ``common`` holds what every command shares, ``dead`` and ``status``
their commands, ``spark`` the ``backfill`` and ``reconcile`` commands (whose
pipelines are in ``drain.spark``).

The top layer: it may import everything; nothing imports it except the
``__main__`` entry points.
"""
