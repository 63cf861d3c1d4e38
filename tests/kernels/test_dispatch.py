"""The dispatcher: backend choice, clear errors, both backends agree, lazy triton import."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_testing import DEVICE, TOL, assert_verbose_allclose, requires_triton

from ragkv.kernels import dispatch
from ragkv.kernels import dispatch as K


def _args(op):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    if op == "rope_shift":
        return (r(2, 9, 64), torch.arange(9, device=DEVICE) - 4, torch.rand(32, generator=g).to(DEVICE)), {}
    if op == "kv_deviation":
        return (r(2, 9, 64), r(2, 9, 64), r(2, 9, 64), r(2, 9, 64)), {"mode": "kv"}
    if op == "scatter_rows":
        return (r(2, 9, 64), r(2, 3, 64), torch.tensor([0, 4, 8], device=DEVICE)), {}
    return (r(6, 4, 64), r(2, 9, 64), r(2, 9, 64), torch.tensor([0, 3, 5, 8], device=DEVICE)), {}


@requires_triton
@pytest.mark.parametrize("op", ["rope_shift", "kv_deviation", "scatter_rows", "blend_attention"])
def test_both_backends_agree(op):
    args, kwargs = _args(op)
    fn = getattr(K, op)
    with K.use_backend("torch"):
        ref = fn(*(a.clone() for a in args), **kwargs)
    with K.use_backend("triton"):
        assert K.resolve_backend(op, args[0].device) == "triton"
        got = fn(*(a.clone() for a in args), **kwargs)
    assert_verbose_allclose(got, ref, *TOL[torch.float32])


def test_choice_order(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert K.get_backend() == "auto"
    assert K.resolve_backend("rope_shift", cpu) == "torch"  # auto on CPU
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert K.get_backend() == "torch"
    with K.use_backend("auto"):
        assert K.get_backend() == "auto"
        with K.use_backend("triton"):
            assert K.get_backend() == "triton"
        assert K.get_backend() == "auto"
    assert K.get_backend() == "torch"
    K.set_backend("triton")
    try:
        assert K.get_backend() == "triton"
    finally:
        K.set_backend(None)
    assert K.get_backend() == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="expected one of"):
        K.get_backend()
    with pytest.raises(ValueError, match="expected one of"):
        K.use_backend("fast").__enter__()


def _run(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", dispatch.ENV_VAR)}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=120)


def test_works_without_triton():
    # triton made unimportable: the package imports, the torch path runs, forcing triton is a clear error
    result = _run("""
        import sys
        sys.modules["triton"] = None
        import torch
        from ragkv.kernels import dispatch as K
        assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
        k = torch.randn(2, 5, 8)
        K.rope_shift(k, torch.arange(5), torch.ones(4))
        K.kv_deviation(k, k, mode="k")
        K.scatter_rows(k, k[:, :2], torch.tensor([3, 4]))
        K.blend_attention(torch.randn(4, 2, 8), k, k, torch.tensor([1, 4]))
        with K.use_backend("triton"):
            try:
                K.rope_shift(k, torch.arange(5), torch.ones(4))
            except RuntimeError as e:
                print("ERR", e)
    """)
    assert result.returncode == 0, result.stderr
    assert "ERR RAGKV_KERNELS=triton but triton is not importable" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter error")
def test_forced_triton_on_cpu_without_interpreter_is_a_clear_error():
    result = _run("""
        import sys, torch
        from ragkv.kernels import dispatch as K
        assert "triton" not in sys.modules  # importing the package does not import triton
        k = torch.randn(2, 5, 8)
        try:
            K.rope_shift(k, torch.arange(5), torch.ones(4))
        except RuntimeError as e:
            print("ERR", e)
    """, RAGKV_KERNELS="triton")
    assert result.returncode == 0, result.stderr
    assert "ERR RAGKV_KERNELS=triton on CPU tensors needs triton's interpreter" in result.stdout
