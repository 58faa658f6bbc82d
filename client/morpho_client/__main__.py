"""`python -m morpho_client`: the morpho-client command."""
import sys

from morpho_client.cli import main

sys.exit(main())
