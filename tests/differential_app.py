"""The Celery app ``drain run --app tests.differential_app`` loads in the
differential routing test: built by tests/route_shapes.py from the spec in the
JSON file ``DIFF_APP_SPEC``, as the test builds it in its own process."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests import route_shapes

app = route_shapes.build_app(json.loads(Path(os.environ["DIFF_APP_SPEC"]).read_text()),
                             os.environ.get("DIFF_BROKER_URL", "amqp://guest:guest@127.0.0.1//"))
