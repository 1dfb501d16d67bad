import sys

from signaling.cli import main

sys.exit(main())
