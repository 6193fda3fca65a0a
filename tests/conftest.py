"""Suite-wide pytest hooks: per-file durations at the end of every run.

``make test`` prints pytest's own progress and its slowest 15 tests (``--durations=15`` in
pytest.ini); this adds the slowest 15 test *files* (setup + call + teardown of every test in the
file, summed), which is where the suite's time goes when many small tests share one slow launch.
``--file-durations=N`` changes the count (0: every file).
"""

from __future__ import annotations

import collections


def pytest_addoption(parser):
    parser.addoption("--file-durations", type=int, default=15, metavar="N",
                     help="show the N slowest test files at the end (0: all)")


class FileDurations:
    """Seconds per test file, summed over every phase report of its tests."""

    def __init__(self, count: int):
        self.count, self.seconds = count, collections.Counter()

    def pytest_runtest_logreport(self, report):
        # one report per phase (setup, call, teardown): a module-scoped fixture's setup lands on
        # the file's first test, so the file's sum counts it once
        self.seconds[report.nodeid.split("::", 1)[0]] += getattr(report, "duration", 0.0) or 0.0

    def pytest_terminal_summary(self, terminalreporter):
        if not self.seconds:
            return
        rows = self.seconds.most_common(self.count or None)
        terminalreporter.write_sep("=", f"slowest {len(rows)} test files (setup + call + teardown)")
        for path, s in rows:
            terminalreporter.write_line(f"{s:8.1f}s  {path}")
        terminalreporter.write_line(f"{sum(self.seconds.values()):8.1f}s  in all "
                                    f"({len(self.seconds)} files)")


def pytest_configure(config):
    config.pluginmanager.register(FileDurations(config.getoption("file_durations")),
                                  "hybridrl-file-durations")
