"""``python -m shard.checkpoint {inspect,consolidate} ...``."""

import sys

from shard.checkpoint._tools import run

code, text = run()
print(text, file=sys.stderr if code else sys.stdout)
raise SystemExit(code)
