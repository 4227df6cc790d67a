"""``python -m dispatcher``: the same CLI as ``twogrid``."""

import sys

from dispatcher.cli import main

sys.exit(main())
