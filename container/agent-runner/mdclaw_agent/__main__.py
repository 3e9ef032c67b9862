import sys

from mdclaw_agent.runner import main

sys.exit(main())
