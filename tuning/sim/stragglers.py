"""The slowest GPU sets a synchronous step's pace: the straggler term of the simulator.

GPUs of one SKU do not run equally fast. Power management and manufacturing variability leave each
GPU with its own sustained clock under load, and the spread is persistent per GPU. Sinha et al.
("Not All GPUs Are Created Equal: Characterizing Variability in Large-Scale, Accelerator-Rich Systems",
SC22, arXiv 2208.11035) measured it on over 90% of the GPUs of five clusters (V100 on Summit, Vortex,
Longhorn and Frontera; MI60 on Corona): an average performance variation of 8% across GPUs for the
compute-bound SGEMM and ResNet/BERT training, whatever the cluster or cooling. Their variation is the
box plot's whisker span over the median, (Q3 + 1.5 IQR - (Q1 - 1.5 IQR)) / Q2 = 4 IQR / median
(hal-uw/gpu_variability_sc22_artifact, plot_script/plot_aggregated.py); for a normal spread
IQR = 1.349 sd, so 8% is a standard deviation of 8 / (4 x 1.349) = 1.48% of the median speed
(`GPU_SPEED_SD`, the GPU presets' `ClusterSpec.gpu_speed_sd`; cited as `gpu-variability` in
tuning/data/kernels.yaml's sources). No stored source measures an A100 or H100 fleet: every GPU preset
takes it.

The kernel rates (tuning/data/kernels.yaml) are one GPU's: a median GPU. A data-parallel step
synchronises every GPU of the job at least once (the gradient reduction; tensor- and pipeline-parallel
groups more often), so its compute runs at the pace of the slowest of `gpus` GPUs: the median's time
x (1 + sd x E[max of gpus standard normals]). The expected maximum is Blom's (1958) order-statistic
approximation, Phi^-1((n - 0.375) / (n + 0.25)): 4.5% over the exact value at 2 GPUs, within 0.8% from 8
to 10^4. Communication is not stretched: the links do not run at the GPU's clock.
"""
from __future__ import annotations

import functools
from statistics import NormalDist

GPU_SPEED_SD = 8.0 / (4.0 * 1.349) / 100.0  # Sinha et al. SC22: 8% average whisker span (4 IQR / median)


@functools.lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (Blom's approximation; 0 for one GPU)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def slowest_gpu_factor(gpus: int, speed_sd: float) -> float:
    """How much longer the slowest of `gpus` GPUs takes than the median GPU, as a share of the
    median's time (the job's compute is stretched by this)."""
    return speed_sd * expected_max_normal(int(gpus)) if speed_sd else 0.0


__all__ = ["GPU_SPEED_SD", "expected_max_normal", "slowest_gpu_factor"]
