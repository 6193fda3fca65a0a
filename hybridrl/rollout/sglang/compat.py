"""Which SGLang releases the adapter supports, and the release facts it branches on.

Contract:
- SGLang pins torch exactly, so a release is usable only with the torch the project pins
  (``TORCH_PIN``, the Makefile's ``torch==2.13.0``). From the released wheels' metadata:
  0.5.18-0.5.21 pin torch==2.13.0, 0.5.22-0.5.23 pin torch==2.14.1. ``SUPPORTED`` is the
  half-open range [0.5.18, 0.5.22) that setup.py's ``gpu`` extra pins; ``TEST_PIN`` is the one
  release the test extra installs (``pip install --no-deps``) so that the contract tests read
  its source. Moving both pins: docs/rollout.md ("Version pairing").
- Weight-update sessions: from ``SESSION_FROM`` (0.5.21) ``update_weights_from_tensor`` returns
  ``(False, "...must run between begin_weight_update() and end_weight_update()")`` outside a
  session; older releases have no session calls. ``has_weight_update_session(version)``.
- ``check_versions(sglang_version, torch_version)``: ImportError (one line naming both versions
  and the supported range) unless the pair is supported; local tags (``+cu130``) are ignored.
- ``import_sglang()``: checks the installed versions first, then imports ``sglang``; either
  failure is an ImportError naming the install command. Nothing here imports SGLang at import
  time.
"""

from __future__ import annotations

import re

TORCH_PIN = "2.13.0"
SUPPORTED = ("0.5.18", "0.5.22")  # [low, high): every release in it pins torch==TORCH_PIN
TEST_PIN = "0.5.21"
SESSION_FROM = "0.5.21"
LOAD_FORMAT = "direct"  # SGLang's loader for tensors already in the rank's parameter shape
INSTALL = "pip install -e '.[gpu]'"


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.5.21.post1' / '2.13.0+cu130' -> (0, 5, 21); ValueError when it has no x.y.z."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"cannot read a version number from {version!r}")
    return tuple(int(g) for g in m.groups())


def has_weight_update_session(version: str) -> bool:
    return version_tuple(version) >= version_tuple(SESSION_FROM)


def check_versions(sglang_version: str, torch_version: str) -> None:
    """ImportError unless this SGLang release is supported and runs on the installed torch."""
    low, high = (version_tuple(v) for v in SUPPORTED)
    ok_sglang = low <= version_tuple(sglang_version) < high
    ok_torch = version_tuple(torch_version) == version_tuple(TORCH_PIN)
    if not (ok_sglang and ok_torch):
        raise ImportError(
            f"sglang {sglang_version} with torch {torch_version} is not supported: hybridrl "
            f"needs sglang >={SUPPORTED[0]},<{SUPPORTED[1]} with torch=={TORCH_PIN} (those "
            f"releases pin that torch); install them with {INSTALL}")


def import_sglang():
    """The ``sglang`` module, after the version check; ImportError with the fix otherwise."""
    from importlib import metadata

    import torch

    try:
        installed = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise ImportError("rollout.engine=sglang needs SGLang, which is not installed here; "
                          f"install the GPU extra on a CUDA machine ({INSTALL}) or use "
                          "rollout.engine=builtin") from None
    check_versions(installed, torch.__version__)
    try:
        import sglang
    except ImportError as err:
        raise not_importable(err) from None
    return sglang


def not_importable(err: ImportError) -> ImportError:
    """The one-line error for an installed SGLang whose modules cannot be imported here (a
    CPU machine without its GPU dependencies, e.g. torchvision)."""
    return ImportError(
        f"rollout.engine=sglang needs SGLang, which cannot be imported here "
        f"({err.__class__.__name__}: {err}); install the GPU extra on a CUDA machine "
        f"({INSTALL}) or use rollout.engine=builtin")
