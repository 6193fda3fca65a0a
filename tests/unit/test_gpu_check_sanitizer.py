"""scripts/kernel_sanitizer_cases.py without a GPU: its GAE cases reach every launch shape of
csrc/cuda/gae_plan.h (per dtype, shared blocks with a short last block) by the NumPy emulation's
plan, on the H200 and other SM counts; the checker catches a gap; the KL cases cover every
(forward, backward) code pair the op accepts."""

import dataclasses
import sys
from pathlib import Path

import pytest

from hybridrl.kernels import reference
from tests.unit.gae_cuda_emulation import plan_gae

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import kernel_sanitizer_cases as ksc  # noqa: E402


@pytest.mark.parametrize("sms", [132, 114, 108, 80, 7, 1])  # H200/H100 SXM, H100 PCIe, A100, ...
def test_gae_cases_reach_every_launch_shape(sms):
    cases = ksc.gae_launch_cases(sms)
    assert ksc.coverage_problems(cases, plan_gae, sms) == []
    for dtype in ksc.DTYPES:
        full = 4 if dtype == "float64" else 8
        shapes = {plan_gae(c.B, c.T, ksc.acc_bytes(dtype), sms)[:2]
                  for c in cases if c.dtype == dtype}
        assert shapes == {(32, full // 2), (32, full), (64, full), (128, full), (256, full),
                          (256, full // 2)}
        rows = {plan_gae(c.B, c.T, ksc.acc_bytes(dtype), sms)[2] for c in cases
                if c.dtype == dtype}
        assert {2, 4, 8} <= rows  # rows sharing a block at each width that allows it


def test_gae_cases_stay_small_for_the_sanitizer():
    elements = sum(c.B * c.T for c in ksc.gae_launch_cases(132))
    assert elements < 4_000_000  # memcheck/racecheck slow the scan 10-100x


def test_coverage_check_finds_a_gap():
    cases = ksc.gae_launch_cases(132)
    no_128 = [c for c in cases if c.shape != (128, 8) or c.dtype != "float32"]
    problems = ksc.coverage_problems(no_128, plan_gae, 132)
    assert problems == ["float32: launch shapes never reached: [(128, 8)]"]
    wrong = [dataclasses.replace(cases[0], T=cases[0].T + 400)] + cases[1:]
    assert "the plan launches (64, 8)" in ksc.coverage_problems(wrong, plan_gae, 132)[0]
    full_blocks = [dataclasses.replace(c, B=c.B + 1) if c.rows_per_block == 2 else c
                   for c in cases]  # 4 * sms rows: every 2-row block full
    assert any("no row slot past B" in p
               for p in ksc.coverage_problems(full_blocks, plan_gae, 132))


def test_kl_cases_cover_every_code_pair_the_op_takes():
    taken = {reference.parse_kl_kind(k) for k in ksc.KL_KINDS}
    every = {reference.parse_kl_kind(k) for k in reference.KL_KINDS}
    assert taken == every and len(taken) == len(ksc.KL_KINDS)  # no alias run twice
    assert (reference.KL_K1, reference.KL_K1) in taken  # k1 through the kernel, not eager


@pytest.mark.slow
def test_the_cases_pass_on_the_cpu_kernels(capsys):
    # the same case code as under compute-sanitizer, on hybridrl._C: a bug in a case (a wrong
    # reference, a misalignment that is not, a broken index) fails here, not on the lent GPU
    assert ksc.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in out] == ["gae", "kl", "whiten"]
    assert out[0] == "gae: ok, 52 launches: 6 shapes x 4 dtypes, shared blocks (132 SMs)"
