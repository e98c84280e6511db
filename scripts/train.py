"""The main job from a clone: `automicro.train` (`python -m automicro.train`, the same arguments).

    python scripts/train.py configs/tiny-cpu.yaml [key=value ...]   # or a shipped name: tiny-cpu
    composer -n 2 scripts/train.py tiny-cpu [key=value ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from automicro.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
