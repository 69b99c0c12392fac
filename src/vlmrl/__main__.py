import sys

from vlmrl.cli import main

sys.exit(main())
