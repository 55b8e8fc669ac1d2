"""The trainer tests import their kit (trainerkit.py) and run training scripts beside it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
