"""Inputs issue 43's probe found not clean, checked without the launcher (scripts/bad_inputs.py
runs them through it): out-of-range numbers refused in one line, a forking reward function's
child ended before it runs trainer code, the launcher's lines for a crashed rank and a busy
master port."""

from __future__ import annotations

import os

import pytest

from hybridrl.config.loader import load_config
from hybridrl.rewards.scoring import RewardScorer


@pytest.mark.parametrize("override,says", [
    ("trainer.seed=18446744073709551616", "trainer.seed must be an integer in [-2**63"),
    ("trainer.seed=-9223372036854775809", "trainer.seed must be an integer in [-2**63"),
    ("data.seed=18446744073709551616", "data.seed must be an integer in [-2**63"),
    ("reward.timeout_s=nan", "reward.timeout_s must be a finite number >= 0"),
    ("reward.timeout_s=inf", "reward.timeout_s must be a finite number >= 0"),
])
def test_out_of_range_numbers_are_one_line(override, says):
    with pytest.raises(ValueError) as err:
        load_config([], [override])
    assert says in str(err.value) and "\n" not in str(err.value).strip()


def test_in_range_edges_still_load():
    cfg = load_config([], ["trainer.seed=9223372036854775807", "data.seed=-9223372036854775808",
                           "reward.timeout_s=0"])
    assert cfg.trainer.seed == 2**63 - 1 and cfg.data.seed == -(2**63)


def test_a_forking_reward_function_never_runs_trainer_code_in_its_child(tmp_path):
    marker = tmp_path / "after_scoring"
    read_end, write_end = os.pipe()

    def forks(data_source, solution_str, ground_truth, extra_info=None):
        if os.fork() == 0:
            os.write(write_end, str(os.getpid()).encode())
        return 1.0

    scores, _ = RewardScorer(custom_fn=forks).score_batch(["a"], ["b"], ["c"])
    with open(marker, "a") as f:  # the "trainer code" after scoring: the parent's only
        f.write(f"{os.getpid()}\n")
    child = int(os.read(read_end, 32))
    _, status = os.waitpid(child, 0)
    os.close(read_end)
    os.close(write_end)
    assert scores.tolist() == [1.0] and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert marker.read_text() == f"{os.getpid()}\n"


def test_launcher_lines_for_a_crashed_rank_and_a_busy_port():
    from hybridrl.launch import crash_line, network_line

    assert crash_line(3, -11).startswith("hybridrl.launch: error: rank 3 died of SIGSEGV")
    assert crash_line(0, -9) is None and crash_line(0, 1) is None and crash_line(0, -15) is None

    class Args:
        master_port = 29500

    err = RuntimeError("The server socket has failed to listen on any local network address. "
                       "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: x")
    line = network_line(err, Args())
    assert "master port 29500 is already in use" in line and "\n" not in line
