"""Collective times inside the NVLink domain and across the scale-out network (vectorised)."""
from __future__ import annotations

import numpy as np

from tokenmill.sim.hardware import GpuSpec

# All-to-all reaches about 3/4 of the ring efficiency: fitted so that GB200 DeepSeek dispatch of
# 128 tokens/rank at EP32 lands at the ~40 us the TensorRT-LLM wide-EP blog reports.
A2A_EFFICIENCY_RATIO = 0.75


def group_bandwidth(gpu: GpuSpec, group: np.ndarray) -> np.ndarray:
    """Per-GPU bandwidth of a ring over `group` GPUs: NVLink inside a domain, else the NIC."""
    return np.where(np.asarray(group) <= gpu.domain_size, gpu.nvlink_bw, gpu.scaleout_bw) * gpu.link_eff


def allreduce_time(gpu: GpuSpec, group: np.ndarray, nbytes: np.ndarray, latency_scale: float = 1.0) -> np.ndarray:
    """All-reduce of `nbytes` per GPU: a ring inside one NVLink domain, hierarchical across domains.

    Inside a domain 2(n-1)/n of the message crosses each GPU's NVLink. Across domains NCCL runs one
    ring per NIC (one NIC per GPU), so after the in-domain reduce-scatter each GPU ships only its
    1/d slice over the scale-out network: every NIC of the domain works in parallel, and the network
    sees 2(k-1)/k of the message divided by the d GPUs of a domain (k domains in the group).
    """
    n = np.asarray(group, dtype=np.float64)
    d = np.minimum(n, float(gpu.domain_size))
    k = np.ceil(n / d)
    nvlink = 2.0 * (d - 1.0) / np.maximum(d, 1.0) * nbytes / (gpu.nvlink_bw * gpu.link_eff)
    network = 2.0 * (k - 1.0) / k * nbytes / d / (gpu.scaleout_bw * gpu.link_eff)
    hops = np.where(k > 1, 2.0, 1.0)  # a cross-domain all-reduce pays the NVLink and the network latency
    t = hops * gpu.collective_latency_s * latency_scale + nvlink + network
    return np.where(n > 1, t, 0.0)


def distinct_ranks(ep: np.ndarray, top_k: int) -> np.ndarray:
    """Expected number of EP ranks a token's top-k experts land on (duplicates sent once)."""
    ep = np.asarray(ep, dtype=np.float64)
    return ep * (1.0 - (1.0 - 1.0 / ep) ** top_k)


def alltoall_time(gpu: GpuSpec, group: np.ndarray, nbytes: np.ndarray, latency_scale: float = 1.0) -> np.ndarray:
    """One all-to-all phase sending `nbytes` from each GPU, split between NVLink and the NIC.

    Destinations inside the sender's domain go over NVLink; the rest must leave through the
    scale-out NIC, which is usually the bottleneck once a group spans domains.
    """
    n = np.asarray(group, dtype=np.float64)
    in_domain = np.minimum(n, gpu.domain_size)
    remote_share = (n - 1.0) / np.maximum(n, 1.0)
    local_part = np.where(n > 1, (in_domain - 1.0) / np.maximum(n - 1.0, 1.0), 0.0)
    eff = gpu.link_eff * A2A_EFFICIENCY_RATIO
    t_nvl = nbytes * remote_share * local_part / (gpu.nvlink_bw * eff)
    t_nic = nbytes * remote_share * (1.0 - local_part) / (gpu.scaleout_bw * eff)
    t = gpu.a2a_latency_s * latency_scale + np.maximum(t_nvl, t_nic)
    return np.where(n > 1, t, 0.0)


def p2p_time(gpu: GpuSpec, crosses_domain: np.ndarray, nbytes: np.ndarray, latency_scale: float = 1.0) -> np.ndarray:
    """Pipeline send of activations to the next stage."""
    bw = np.where(crosses_domain, gpu.scaleout_bw, gpu.nvlink_bw) * gpu.link_eff
    return gpu.collective_latency_s * latency_scale + nbytes / bw
