import sys

from longctx.entrypoints.cli import main

sys.exit(main())
