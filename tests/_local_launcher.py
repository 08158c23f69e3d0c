"""AReaL's local launcher (``areal.infra.launcher.local``, run unchanged) on a machine
without a GPU.

AReaL's CPU platform names no device-visibility variable (``device_control_env_var``
is ""), and the launcher prefixes the trainer's shell command with ``<that name>=<its
devices>``, which the shell then tries to run as a command called ``=0,0``. Naming
CUDA's variable (meaningless without a GPU) is the one change; everything else (the
torchrun command line, its environment, ``AREAL_SPMD_MODE=1``) is the launcher's own.
"""
import runpy

from areal.infra.platforms.cpu import CpuPlatform

CpuPlatform.device_control_env_var = "CUDA_VISIBLE_DEVICES"
runpy.run_module("areal.infra.launcher.local", run_name="__main__")
