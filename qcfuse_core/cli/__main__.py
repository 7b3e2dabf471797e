import sys

from qcfuse_core.cli.commands import main

sys.exit(main())
