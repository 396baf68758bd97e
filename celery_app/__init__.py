"""An example Celery application consuming jobs staged with drain.

Run a worker with ``celery -A celery_app worker``. It is an ordinary Celery
app: nothing in it knows about drain, which is the point.
"""

from celery_app.app import app

__all__ = ["app"]
