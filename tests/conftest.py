import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import os  # noqa: E402

# Every run in the tests goes through the stream-order checker of the CPU device layer
# (mobius.runtime.device), pipeline workers included (they inherit the environment).
os.environ.setdefault("MOBIUS_CHECK_STREAMS", "1")
