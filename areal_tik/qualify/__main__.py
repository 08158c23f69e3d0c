"""``python -m areal_tik.qualify``: see ``areal_tik.qualify.main``."""
from . import main

raise SystemExit(main())
