"""Experiment: the CUDA-graph floor of a step of 1, 2 or 3 tiny kernels (one 1-element add each) on
one GPU, µs per step: what a dispatch + combine pair costs before any work of its own."""
import torch
from graph_timing import graph_step_us

a = torch.zeros(1, device="cuda")
b = torch.zeros(1, device="cuda")


def step(kernels):
    a.add_(1)
    if kernels > 1:
        b.add_(1)
    if kernels > 2:
        a.add_(1)


for kernels in (1, 2, 3):
    us = graph_step_us(lambda: step(kernels), replays=10)
    print(f"floor: {kernels} tiny kernel(s) per step: {us:.2f} µs per step (median of 10 replays of 200)")
