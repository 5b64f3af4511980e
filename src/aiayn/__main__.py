"""``python -m aiayn …`` (what ``torchrun -m aiayn train …`` runs)."""

import sys

from aiayn.cli import main

sys.exit(main())
