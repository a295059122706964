"""Training metrics: analytic FLOPs (from a family's counts), device peak throughput, writers."""

from MaxText.metrics.flops import FlopCount, training_flops_per_step
from MaxText.metrics.peaks import device_peak_tflops, lookup_peak_tflops, measure_host_matmul_tflops
from MaxText.metrics.writers import REQUIRED_KEYS, MetricsWriter, format_line

__all__ = [
    "FlopCount",
    "REQUIRED_KEYS",
    "MetricsWriter",
    "device_peak_tflops",
    "format_line",
    "lookup_peak_tflops",
    "measure_host_matmul_tflops",
    "training_flops_per_step",
]
