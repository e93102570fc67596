import os
import sys

# `python -m kvops` puts the current directory first on sys.path. In a source checkout that is the repository root,
# whose folders engine/ and kernels/ (installed as kvops.engine and kvops.kernels) would then shadow PyPI packages
# with those top-level names: transformers 5.25 imports Hugging Face's `kernels`, and found kvops's kernels/ folder
# instead. kvops itself is imported from its installation, so the directory is not needed (Python's -P, for kvops).
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from kvops.cli import main

raise SystemExit(main())
