"""Kernel tests run the real kernels on CUDA and triton's CPU interpreter elsewhere.

TRITON_INTERPRET is read when @triton.jit decorates a kernel, i.e. when a kernel module is first imported,
so it is set here, at conftest import time, before any test module imports ragkv.kernels.<op>.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
