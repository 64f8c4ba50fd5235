"""Print the root of the nvidia-nvshmem-cu<major> wheel (include/, lib/), or nothing."""
import importlib.util
import os
import sys

major = sys.argv[1] if len(sys.argv) > 1 else "13"
for name in ("nvidia.nvshmem",):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            if os.path.isdir(os.path.join(root, "include")):
                print(root)
                sys.exit(0)
