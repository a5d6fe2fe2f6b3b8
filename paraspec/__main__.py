import sys

from paraspec.cli.main import main

sys.exit(main())
