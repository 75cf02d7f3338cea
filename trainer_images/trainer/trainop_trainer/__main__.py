import sys

from trainop_trainer.cli import main

sys.exit(main())
