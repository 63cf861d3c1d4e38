import pytest
import torch
from kernel_testing import assert_verbose_allclose


def test_helper_reports_count_worst_and_nan():
    e = torch.zeros(4, 5)
    a = e.clone()
    a[1, 2] = 0.5
    a[3, 4] = float("nan")
    with pytest.raises(AssertionError) as info:
        assert_verbose_allclose(a, e, atol=1e-3, rtol=0)
    msg = str(info.value)
    assert "2 / 20 elements mismatch" in msg
    assert "worst at (3, 4)" in msg
    assert "NaN actual/expected: 1/0" in msg
    assert_verbose_allclose(a.nan_to_num(0.0), e + torch.eye(4, 5) * 0, atol=0.6, rtol=0)
