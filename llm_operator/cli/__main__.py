"""``python -m llm_operator.cli``: the ``llm-operator`` command."""

import sys

from llm_operator.cli.main import main

sys.exit(main())
