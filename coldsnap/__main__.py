import sys

from coldsnap.cli import main

sys.exit(main())
