"""``python -m ddpdoctor.runtime.native``: build the native comm hook (or find it cached)."""

from __future__ import annotations

import sys

from ddpdoctor.runtime.step.native_hook import main

if __name__ == "__main__":
    sys.exit(main())
