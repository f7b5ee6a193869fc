"""ZeRO data parallel with overlap, tensor/sequence parallel with chunked collective matmul,
interleaved 1F1B pipeline with decoupled async p2p.

Built on ``torch.distributed``: process groups, ``DeviceMesh`` and ``DTensor``.
"""

from ms_parallel._tp_comm import TPComm
from ms_parallel._version import __version__
from ms_parallel._wait import CollectiveTimeout
from ms_parallel.chunk_tuner import ChunkTuner
from ms_parallel.collective_matmul import (
    all_gather_matmul,
    gather_sequence,
    matmul_reduce_scatter,
    reduce_scatter_sequence,
    scatter_sequence,
)
from ms_parallel.engine import (
    DDPEngine,
    LossFn,
    OptimizerFactory,
    ShardSpec,
    StepEngine,
    StepResult,
    ZeroEngine,
)
from ms_parallel.events import Event, EventHook, EventLog
from ms_parallel.latency import LatencyBackend, register_latency_backend
from ms_parallel.mesh import build_mesh
from ms_parallel.mesh_shape import MESH_DIM_NAMES, MeshShape
from ms_parallel.zero import ZeroDataParallel, default_chunks

__all__ = [
    "MESH_DIM_NAMES",
    "ChunkTuner",
    "CollectiveTimeout",
    "DDPEngine",
    "Event",
    "EventHook",
    "EventLog",
    "LatencyBackend",
    "LossFn",
    "MeshShape",
    "OptimizerFactory",
    "ShardSpec",
    "StepEngine",
    "StepResult",
    "TPComm",
    "ZeroDataParallel",
    "ZeroEngine",
    "__version__",
    "all_gather_matmul",
    "build_mesh",
    "default_chunks",
    "gather_sequence",
    "matmul_reduce_scatter",
    "reduce_scatter_sequence",
    "register_latency_backend",
    "scatter_sequence",
]
