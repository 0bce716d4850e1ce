"""Hybrid routed experts: the hot experts on the accelerator, the others on the CPU kernels, in parallel.

`HybridExpertBackend` wraps the layer's CPU backend (the C++ kernels, or the torch reference on the host). The
router has run on the accelerator; per call:

1. `submit`: the routing comes to the host (it is needed there anyway). Each token's assignments to hot experts
   are redirected to one of its own cold experts with weight 0, and only the tokens with at least one cold
   assignment are submitted to the CPU backend (asynchronously: the C++ kernels run on their own threads). So
   the CPU never computes a hot expert, and the kernels need no change: the redirected row is an extra row of
   an expert the kernels read for that token anyway, which at decode costs almost nothing (the weights are
   streamed once for all rows), and times 0 it adds exactly nothing. The hidden states go to the host for it
   (a no-op on the stand-in).
   Then the hot assignments are computed on the accelerator (`TorchExpertBackend` over the hot experts' device
   copies) while the CPU works. The MoE block runs the shared experts (on the accelerator) next.
2. `wait`: the CPU's result comes back to the accelerator and is added to the hot experts' output there.

Without hot experts this is the CPU backend with the host<->accelerator moves of the hidden states around it.
Times go to the engine's RunStats: the CPU kernels' time from submit until their result is in hand, the part of
it the forward waited for, and the assignments computed on each side.

Legend: T tokens, H hidden, K top-k, E experts, A assignments.
"""

from __future__ import annotations

import time

import torch

from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.accel.stats import RunStats
from hybridmoe.layers.moe.backend import ExpertBackend, ExpertWeights
from hybridmoe.layers.moe.torch_backend import TorchExpertBackend

HOST = torch.device("cpu")


class TimedOnDevice:
    """A part that runs on the accelerator (router, shared experts, stream-loading prefill's experts) whose calls
    count as accelerator time."""

    def __init__(self, part, stats: RunStats):
        self.part, self.stats = part, stats

    def route(self, x: torch.Tensor):
        with self.stats.accel_section():
            return self.part.route(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.stats.accel_section():
            return self.part.forward(x)

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        with self.stats.accel_section():
            return self.part.submit(hidden, topk_ids, topk_weights)

    def wait(self, handle) -> torch.Tensor:
        with self.stats.accel_section():
            return self.part.wait(handle)

    def __getattr__(self, name: str):
        attr = getattr(self.part, name)
        if name != "run":
            return attr

        def run(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
            with self.stats.accel_section():  # a backend's blocking call, timed as its submit and wait are
                return attr(hidden, topk_ids, topk_weights)
        return run


def redirect_hot(topk_ids: torch.Tensor, topk_weights: torch.Tensor, is_hot: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU's share of a routing (host tensors): topk_ids, topk_weights [T, K] and is_hot [T, K] bool ->
    (rows [R] of the tokens with a cold assignment, their ids [R, K] with each hot assignment replaced by the
    token's first cold expert, their weights [R, K] with those assignments at 0)."""
    cold = ~is_hot
    rows = cold.any(dim=1).nonzero().squeeze(1)  # [R]
    first_cold = cold.to(torch.int8).argmax(dim=1, keepdim=True)  # [T, 1] position of each token's first cold one
    stand_in = topk_ids.gather(1, first_cold).expand_as(topk_ids)  # [T, K]
    ids = torch.where(is_hot, stand_in, topk_ids)
    weights = torch.where(is_hot, torch.zeros_like(topk_weights), topk_weights)
    return rows, ids[rows], weights[rows]


class HybridExpertBackend:
    """ExpertBackend: hot experts on the accelerator, the rest on `cpu` (see module docstring)."""

    def __init__(self, cpu: ExpertBackend, hot: tuple[int, ...], hot_weights: ExpertWeights | None,
                 num_experts: int, accel: Accelerator, stats: RunStats):
        self.cpu, self.hot, self.accel, self.stats = cpu, tuple(hot), accel, stats
        self.weights = getattr(cpu, "weights", None)  # all the layer's experts as loaded, as on the CPU backend
        self.device = accel.device
        local = torch.full((num_experts,), -1, dtype=torch.long)  # [E] expert -> its index among the hot, or -1
        local[list(self.hot)] = torch.arange(len(self.hot))
        self.local = local
        self.hot_backend = TorchExpertBackend(hot_weights) if self.hot else None

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """hidden [T, H] (on the accelerator or the host), topk_ids, topk_weights [T, K] -> handle."""
        num_tokens = hidden.shape[0]
        ids, weights = topk_ids.to(HOST), topk_weights.to(HOST)
        local = self.local[ids]  # [T, K]
        is_hot = local >= 0
        num_hot = int(is_hot.sum())
        cpu_handle, rows, started = None, None, time.perf_counter()
        if num_hot < is_hot.numel():
            x = hidden.to(HOST)
            if num_hot:
                rows, cpu_ids, cpu_weights = redirect_hot(ids, weights, is_hot)
                cpu_handle = self.cpu.submit(x[rows], cpu_ids, cpu_weights)
            else:
                cpu_handle = self.cpu.submit(x, ids, weights)
        hot_out = None
        if num_hot:
            with self.stats.accel_section():
                token, slot = is_hot.nonzero(as_tuple=True)  # [A], [A]
                token_dev = token.to(self.device)
                x_hot = hidden.to(self.device)[token_dev]  # [A, H]
                out = self.hot_backend.submit(x_hot, local[token, slot][:, None].to(self.device),
                                              weights[token, slot][:, None].to(self.device))  # [A, H]
                hot_out = torch.zeros(num_tokens, hidden.shape[1], dtype=hidden.dtype, device=self.device)
                hot_out.index_add_(0, token_dev, self.hot_backend.wait(out))
        return (cpu_handle, rows, hot_out, started, num_tokens, hidden.dtype, is_hot.numel() - num_hot, num_hot)

    def wait(self, handle) -> torch.Tensor:
        """-> [T, H] on the accelerator: the CPU's experts plus the hot ones."""
        cpu_handle, rows, hot_out, started, num_tokens, dtype, num_cold, num_hot = handle
        if cpu_handle is None:
            self.stats.add_cpu_experts(0.0, 0.0, 0, num_hot)
            return hot_out
        waiting = time.perf_counter()
        cpu_out = self.cpu.wait(cpu_handle)
        done = time.perf_counter()
        self.stats.add_cpu_experts(done - started, done - waiting, num_cold, num_hot)
        cpu_out = cpu_out.to(self.device, non_blocking=True)
        if rows is None:  # every token went to the CPU
            return cpu_out if hot_out is None else cpu_out + hot_out
        if hot_out is None:
            hot_out = torch.zeros(num_tokens, cpu_out.shape[1], dtype=dtype, device=self.device)
        return hot_out.index_add_(0, rows.to(self.device), cpu_out)
