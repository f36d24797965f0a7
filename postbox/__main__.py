"""`python -m postbox ...` is the `postbox` command."""

import sys

from postbox.relay.cli import main

if __name__ == "__main__":
    sys.exit(main())
