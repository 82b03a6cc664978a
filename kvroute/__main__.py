import sys

from kvroute.cli import main

sys.exit(main())
