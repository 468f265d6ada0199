"""Expert parallelism: mixture-of-experts layers with their experts split over a mesh axis, exact to one device. The
router, its losses and the dispatch, expert compute and combine over an axis as pure functions (``routing``), the
Linen layer and the ``expert`` mesh role (``layer``: ``ExpertParallel``, its registry entry), and the Flax NNX layer
(``nnx``, loaded by ``sc.nnx.MoE`` on first use, so that ``flax.nnx`` loads only when it is used). The tokens move
with :func:`spmdcomm.ragged_all_to_all`."""

from spmdcomm.parallel.expert.capacity import SequenceSplit
from spmdcomm.parallel.expert.layer import MOE_COLLECTION, ExpertParallel, MoE
from spmdcomm.parallel.expert.report import ExpertLayer, ExpertReport
from spmdcomm.parallel.expert.routing import (
    ROUTINGS,
    MoEStats,
    assignment_slots,
    expert_capacity,
    load_balancing_loss,
    moe,
    route,
    router_z_loss,
)

__all__ = [
    "MoE",
    "ExpertParallel",
    "ExpertReport",
    "ExpertLayer",
    "MoEStats",
    "moe",
    "MOE_COLLECTION",
    "ROUTINGS",
    "route",
    "expert_capacity",
    "assignment_slots",
    "SequenceSplit",
    "load_balancing_loss",
    "router_z_loss",
]
