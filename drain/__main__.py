"""``python -m drain`` is the ``drain`` command."""

import sys

from drain.cli import main

sys.exit(main())
