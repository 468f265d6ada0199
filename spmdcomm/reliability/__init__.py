"""Layer 5, reliability: the stuck-step watchdog, preemption, where the time goes (phases) and metric logs."""

from spmdcomm.reliability.metrics import MetricsWriter
from spmdcomm.reliability.phases import PHASE_DESCRIPTIONS, PHASES, PhaseTimer
from spmdcomm.reliability.preemption import PREEMPTED_EXIT_CODE, Preemption
from spmdcomm.reliability.watchdog import STUCK_EXIT_CODE, StuckStepError, Watchdog

__all__ = [
    "Watchdog",
    "StuckStepError",
    "STUCK_EXIT_CODE",
    "Preemption",
    "PREEMPTED_EXIT_CODE",
    "PhaseTimer",
    "PHASES",
    "PHASE_DESCRIPTIONS",
    "MetricsWriter",
]
