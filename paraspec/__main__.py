"""`python -m paraspec`: the command line. Only light imports here: cli.main.main() protects Ctrl-C before torch."""

import sys

from paraspec.cli.main import run

sys.exit(run())
