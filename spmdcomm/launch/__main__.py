"""``python -m spmdcomm.launch``: the launcher's command line (:mod:`spmdcomm.launch.cli`)."""

import sys

from spmdcomm.launch.cli import main

if __name__ == "__main__":  # pytest's --doctest-modules imports this file too
    sys.exit(main())
