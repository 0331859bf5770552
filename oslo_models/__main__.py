"""``python -m oslo_models``: see ``oslo_models.cli``."""
import sys

from .cli import main

sys.exit(main())
