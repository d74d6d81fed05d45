import sys

from ddpdoctor.cli.main import main

sys.exit(main())
