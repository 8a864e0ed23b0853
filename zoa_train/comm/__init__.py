"""1-bit packing, the error-compensated 1-bit allreduce (flat and node-aware), the top-k allreduce, full-precision collectives and their ledger."""

from zoa_train.comm.cluster import ClusterCollective
from zoa_train.comm.collectives import allreduce, default_ledger, group_size_rank, ring_allreduce_bytes
from zoa_train.comm.hierarchical import HierarchicalOneBitAllReduce
from zoa_train.comm.layout import onebit_layout
from zoa_train.comm.ledger import CommLedger, StepComm
from zoa_train.comm.onebit import OneBitAllReduce, TopologyChanged
from zoa_train.comm.packing import pack_signs, sign_table, unpack_signs
from zoa_train.comm.protocol import Collective, CollectiveFactory
from zoa_train.comm.topk import TopKAllReduce

__all__ = [
    "ClusterCollective",
    "Collective",
    "CollectiveFactory",
    "CommLedger",
    "HierarchicalOneBitAllReduce",
    "OneBitAllReduce",
    "StepComm",
    "TopKAllReduce",
    "TopologyChanged",
    "allreduce",
    "default_ledger",
    "onebit_layout",
    "group_size_rank",
    "pack_signs",
    "ring_allreduce_bytes",
    "sign_table",
    "unpack_signs",
]
