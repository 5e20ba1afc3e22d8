"""What a rank forked by ``launch.forked`` sees, written as one JSON line to its output;
it then exits with the code its first argument names (``sleep``: waits to be killed)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

# Whether torch was imported before this module ran: by the forkserver (a forked rank) or
# not at all (a fresh interpreter, which this module never makes import it).
PRELOADED = "torch" in sys.modules

print(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "env": dict(os.environ),
            "nice": os.nice(0),
            "preloaded": PRELOADED,
            "interfaces": sorted(name for _, name in socket.if_nameindex()),
            "main": __name__,
        }
    ),
    flush=True,
)
if sys.argv[1] == "sleep":
    time.sleep(120)
raise SystemExit(int(sys.argv[1]))
