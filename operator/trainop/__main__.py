import sys

from trainop.cli import main

sys.exit(main())
