"""`python -m deltaserve ...`: the same as the `deltaserve` command."""
import sys

from .cli import main

sys.exit(main())
