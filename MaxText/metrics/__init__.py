"""Training metrics: analytic FLOPs, device peak throughput, and metric writers."""

from MaxText.metrics.flops import matmul_param_count, total_param_count, training_flops_per_step
from MaxText.metrics.peaks import device_peak_tflops, lookup_peak_tflops, measure_host_matmul_tflops
from MaxText.metrics.writers import REQUIRED_KEYS, MetricsWriter, format_line

__all__ = [
    "REQUIRED_KEYS",
    "MetricsWriter",
    "device_peak_tflops",
    "format_line",
    "lookup_peak_tflops",
    "matmul_param_count",
    "measure_host_matmul_tflops",
    "total_param_count",
    "training_flops_per_step",
]
