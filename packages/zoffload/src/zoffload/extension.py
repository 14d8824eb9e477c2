"""What zoffload adds to zcore, registered on import (zcore loads it through the
``zcore.extensions`` entry point when a config asks for offload)."""

from __future__ import annotations

from zcore.config import register_feature
from zcore.zero.backends import register_optimizer_backend, register_param_backend
from zoffload.cpu_offload import cpu_optimizer
from zoffload.nvme_optimizer import nvme_optimizer
from zoffload.param_store import host_params, nvme_params

register_feature("zero_optimization.offload_optimizer")
register_feature("aio")  # then validated as zcore.config.aio.AioConfig
register_optimizer_backend("cpu", cpu_optimizer)
register_optimizer_backend("nvme", nvme_optimizer)
register_feature("zero_optimization.offload_param")
register_param_backend("cpu", host_params)
register_param_backend("nvme", nvme_params)
