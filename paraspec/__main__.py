import sys

from paraspec.cli import main

sys.exit(main())
