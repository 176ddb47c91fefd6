import sys

from draplane.cli import main

sys.exit(main())
