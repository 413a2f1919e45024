"""`python -m qarl_cli.cli ...` (torchrun -m qarl_cli.cli ...): the qarl command."""

import sys

from qarl_cli.cli import main

sys.exit(main())
