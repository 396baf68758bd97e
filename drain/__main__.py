"""``python -m drain`` is the ``drain`` command."""

import sys

from drain.cli.main import main

sys.exit(main())
