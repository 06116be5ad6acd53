import os
import sys

# Use the installed package if there is one (CI installs it with pip);
# otherwise the source tree next to this folder, which finds
# build/libsmoe.so in the repository (or $SMOE_LIBRARY).
try:
    import smoe  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
