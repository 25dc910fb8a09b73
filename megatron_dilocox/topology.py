"""Process groups: megatron-core's 3D layout inside a cluster, outer groups across clusters.

``world = C clusters x M ranks`` with ``M = TP x PP x DP_in``; cluster ``k`` owns the
contiguous ranks ``[k*M, (k+1)*M)``. megatron-core is initialised over the whole world
with the ``tp-pp-dp`` rank order, so that data parallelism is the outermost dimension and
a cluster is exactly a block of ``DP_in`` data-parallel replicas. The per-step groups handed
to DDP and the optimizer (:attr:`Topology.pg_collection`) are then narrowed to the
cluster: with ``C > 1`` no per-step collective leaves a cluster. The outer group of a rank
holds the ``C`` ranks, one per cluster, that own the same parameter shard.

With clusters as independent jobs (``cluster_job``), the world is one cluster: megatron-core's
groups span it, and the ranks that own the same shard in the other clusters are reached only
through the outer exchange (:mod:`megatron_dilocox.outer.cluster_exchange`); this rank's place
in the data-parallel layout over all clusters is the same as in the single world.
"""

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass
class Topology:
    """Where this rank sits and the groups it talks on."""

    clusters: int
    """C: number of clusters. Without DiLoCoX they only partition the world for byte accounting."""
    cluster_size: int
    """M: ranks per cluster (TP x PP x DP_in)."""
    cluster_rank: int
    """k: the cluster this rank belongs to."""
    data_parallel_size: int
    """Data-parallel replicas over all clusters; the global batch is split over them."""
    data_parallel_rank: int
    """Index of this rank's replica over all clusters (cluster-major)."""
    inner_dp_size: int
    """Replicas that reduce gradients together every step: DP_in under DiLoCoX, else all of DP."""
    inner_dp_rank: int
    """This rank's index among them."""
    pg_collection: ProcessGroupCollection
    """megatron-core groups for DDP, optimizer and grad finalisation (cluster-local)."""
    cluster_group: dist.ProcessGroup
    """All ranks of this rank's cluster."""
    outer_group: dist.ProcessGroup | None
    """The C ranks holding this rank's shard in every cluster (None when C = 1)."""
    outer_reduce_group: dist.ProcessGroup | None
    """A second group over the same ranks, used only by the background outer reduction, so
    that it never interleaves with the foreground outer collectives."""
    exchange_group: dist.ProcessGroup | None = None
    """Clusters as jobs: a gloo group over this cluster, used only by the background outer
    exchange to agree on what was delivered (None for a one-rank cluster)."""


def init_distributed(backend: str, timeout_minutes: int) -> None:
    """Initialises the default process group from torchrun's environment.

    Under torchrun every attempt (``--max-restarts``) connects to the same agent store, whose keys
    of the previous attempt are still there: a restarted rank could read a dead peer's address and
    fail to connect. So a restarted attempt's groups keep their keys under a prefix of their own.
    """
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend=backend, timeout=timeout, store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def _new_groups(rank_lists, timeout=None, backend=None):
    """Creates every group in ``rank_lists`` (all ranks must call this alike) and returns
    the one containing this rank, or None."""
    mine = None
    me = dist.get_rank()
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks, timeout=timeout, backend=backend)
        if me in ranks:
            mine = group
    return mine


def build_topology(tp: int, pp: int, vpp: int | None, clusters: int = 1, dilocox: bool = False,
                   outer_timeout_s: float = 3600.0, outer_backend: str | None = None,
                   cluster_job: int | None = None) -> Topology:
    """Initialises megatron-core's parallel state and, for DiLoCoX, the cluster/outer groups.

    Must be called by every rank with the same arguments, after :func:`init_distributed`.
    Without ``dilocox`` the clusters only say which traffic counts as cross-cluster.
    ``outer_backend``: backend of the outer groups (default: the world's), e.g. ``"gloo"``
    for an exchange staged through host memory. ``cluster_job``: this world is cluster
    ``cluster_job`` of ``clusters``, run as its own job (``--dilocox-lighthouse``).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world % (tp * pp * (1 if cluster_job is not None else clusters)) == 0, "checked by arguments.validate_world"
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        order="tp-cp-ep-pp-dp",
    )
    model_parallel = tp * pp
    dp_rank = rank // model_parallel
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    if cluster_job is not None:
        inner_dp = world // model_parallel
        return Topology(
            clusters=clusters, cluster_size=world, cluster_rank=cluster_job,
            data_parallel_size=clusters * inner_dp, data_parallel_rank=cluster_job * inner_dp + dp_rank,
            inner_dp_size=inner_dp, inner_dp_rank=dp_rank, pg_collection=pgc, cluster_group=dist.group.WORLD,
            outer_group=None, outer_reduce_group=None,
            exchange_group=dist.new_group(backend="gloo") if world > 1 else None)
    cluster_size = world // clusters
    cluster_rank = rank // cluster_size
    inner_dp = cluster_size // model_parallel
    if not (dilocox and clusters > 1):
        cluster_group, outer_group, outer_reduce_group = dist.group.WORLD, None, None
        inner_dp = world // model_parallel
    else:
        blocks = [list(range(k * cluster_size, (k + 1) * cluster_size)) for k in range(clusters)]
        cluster_group = _new_groups(blocks)
        # Same (tp, pp) coordinate, same cluster: the inner data-parallel group.
        inner_dp_group = _new_groups([
            [k * cluster_size + d * model_parallel + mp for d in range(inner_dp)]
            for k in range(clusters) for mp in range(model_parallel)
        ])
        for name in ("dp", "dp_cp", "intra_dp_cp"):
            setattr(pgc, name, inner_dp_group)
        # The distributed optimizer reduces grad norms over this group: keep it in the cluster.
        pgc.intra_dist_opt = cluster_group
        outer_ranks = [[k * cluster_size + r for k in range(clusters)] for r in range(cluster_size)]
        timeout = datetime.timedelta(seconds=outer_timeout_s)
        outer_group = _new_groups(outer_ranks, timeout, outer_backend)
        outer_reduce_group = _new_groups(outer_ranks, timeout, outer_backend)
    return Topology(
        clusters=clusters,
        cluster_size=cluster_size,
        cluster_rank=cluster_rank,
        data_parallel_size=world // model_parallel,
        data_parallel_rank=dp_rank,
        inner_dp_size=inner_dp,
        inner_dp_rank=dp_rank % inner_dp,
        pg_collection=pgc,
        cluster_group=cluster_group,
        outer_group=outer_group,
        outer_reduce_group=outer_reduce_group,
    )
