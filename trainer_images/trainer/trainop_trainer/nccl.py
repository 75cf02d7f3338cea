"""Which network NCCL chose, read from NCCL's own INFO lines: by the preflight and during training.

    probe = nccl.TransportProbe()       # before the first NCCL communicator: sets NCCL_DEBUG*
    ...                                 # training; NCCL writes its INFO lines to a private file
    probe.poll()                        # "IB" | "Socket" | None; forwards NCCL's warnings

NCCL prints nothing unless NCCL_DEBUG is set. The probe sets NCCL_DEBUG=INFO with
NCCL_DEBUG_SUBSYS=INIT,NET (a few dozen lines per communicator, written when it is made) and
NCCL_DEBUG_FILE=<a file of this process>, so the job's log does not fill with INFO lines. NCCL
writes its warnings (WARN, any subsystem) to that file too; `poll` copies every new `NCCL WARN`
line to stderr, so they still reach the job's log (at the next poll: the trainer polls at every
epoch report and once more when training ends or fails). A user who set NCCL_DEBUG keeps their
own setting and output, and the probe reports no transport.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

# "Using network IB" names the network a communicator uses. Without it (older NCCL), a device
# line: "NET/IB : Using [0]mlx5_0:1/IB ..." or "NET/Socket : Using [0]eth0:...". Not
# "NET/IB : Using [RO]; OOB eth0", which NCCL 2.28 prints with no HCA at all.
_USING_NETWORK = re.compile(r"Using network (\w+)")
_NET_DEVICE = re.compile(r"NET/(IB|Socket) : Using \[\d+\]")
WARN = " NCCL WARN "
TRANSPORTS = ("IB", "Socket")  # what the metrics report may say (docs/DEVELOPING.md)


def transport_from_log(text: str) -> str | None:
    """The network NCCL's INFO lines say it uses: IB, Socket (or a plugin's name); Socket if
    any communicator uses sockets."""
    names = _USING_NETWORK.findall(text) or _NET_DEVICE.findall(text)
    if not names:
        return None
    return "Socket" if "Socket" in names else names[0]


class TransportProbe:
    """NCCL's debug output of this process into a private file, read back incrementally."""

    def __init__(self, env=os.environ, directory: str | None = None):
        self.path: Path | None = None
        self.transport: str | None = None
        self._offset = 0
        self._partial = b""
        self._net_lines: list[str] = []  # only the lines transport_from_log looks at
        if "NCCL_DEBUG" in env:
            return  # the user's choice: their level, their destination
        folder = Path(directory or tempfile.gettempdir())
        self.path = folder / f"trainop-nccl.{os.getpid()}.log"
        # NCCL puts the pid of the process that writes in place of %p: a child process that
        # inherits the variable and happens to log cannot overwrite this process's file.
        env.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                    "NCCL_DEBUG_FILE": str(folder / "trainop-nccl.%p.log")})

    def poll(self, warnings=sys.stderr) -> str | None:
        """Read what NCCL wrote since the last poll: copy its warnings to `warnings`, and return
        the transport once a line names it (IB or Socket; None before, or for another network)."""
        if self.path is None:
            return None
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:  # no communicator yet (or no NCCL: CPU)
            return self.transport
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # NCCL may be writing the last one right now
        for raw in lines:
            line = raw.decode(errors="replace")
            if WARN in line:
                warnings.write(line + "\n")
            elif "Using network" in line or "NET/" in line:
                self._net_lines.append(line)
        if warnings is not None and hasattr(warnings, "flush"):
            warnings.flush()
        found = transport_from_log("\n".join(self._net_lines))
        self.transport = found if found in TRANSPORTS else None
        return self.transport


def gang_transport(socket_ranks: float, ib_ranks: float) -> str | None:
    """The gang's transport from how many ranks saw each (summed over the ranks): sockets on
    any rank slow the whole ring down, so one is enough to say Socket."""
    return "Socket" if socket_ranks > 0 else "IB" if ib_ranks > 0 else None
