#!/usr/bin/env python3
"""gpuctl-node: the node agent's command, ~/.gpuctl/bin/gpuctl-node (installed by prepare).

The agent itself is ~/.gpuctl/lib/gpuctl_node.py, the modules of gpuctl/node/ joined into one
file (configplane/bundle.py). This imports it rather than running it, so Python keeps its
bytecode in ~/.gpuctl/lib/__pycache__ and a call does not compile the agent's 4,700 lines again.
An agent that is missing or damaged (cut short, edited, not loadable) exits 127, as a missing
command does: the controller then prepares this node again by itself.
Standard library only, Python >= 3.6.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib"))
sys.dont_write_bytecode = False  # the cache is the point, whatever PYTHONDONTWRITEBYTECODE says (images set it)
try:
    import gpuctl_node
    main = gpuctl_node.main
except Exception as exc:  # noqa: BLE001 - ImportError, SyntaxError, AttributeError: the same answer
    sys.stderr.write("gpuctl-node: cannot load the agent (%s: %s); gpuctl prepares this node again at its next "
                     "job\n" % (type(exc).__name__, exc))
    sys.exit(127)
gpuctl_node.LAUNCHER = os.path.abspath(__file__)  # what the agent runs again (relay, autostop-watch, ...)
sys.exit(main())
