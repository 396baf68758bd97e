"""The ``drain run`` process: the loop that fetches, publishes and settles
batches (runner, pipeline, settle), its watchdog, outages, metrics and the
status page.

May import every layer below it (postgres, broker, celery, settings and the
foundation); never the CLI.
"""
