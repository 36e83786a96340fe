"""torchft's Lighthouse, as its `torchft_lighthouse` command runs it, through this interpreter:
`python scripts/lighthouse.py --min_replicas 1 --bind [::]:29510` (run_train.sh's FT_LIGHTHOUSE=start,
scripts/ft_demo.sh). torchft parses the process's own arguments after the interpreter, so it is run
as a file, not with -c or -m."""

import sys

from torchft._torchft import lighthouse_main

sys.exit(lighthouse_main())
