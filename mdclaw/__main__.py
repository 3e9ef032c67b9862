import sys

from mdclaw.cli import main

sys.exit(main())
