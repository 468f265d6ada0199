"""Layer 2, the local launcher: ``spmdcomm-launch`` (``python -m spmdcomm.launch``) runs a script as N processes."""

from spmdcomm.launch.cli import main
from spmdcomm.launch.supervisor import GRACE_SECONDS, free_port, launch

__all__ = ["main", "launch", "free_port", "GRACE_SECONDS"]
