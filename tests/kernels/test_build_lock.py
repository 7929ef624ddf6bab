"""The kernels' build lock: a process killed while PyTorch's builder held its ``lock`` file does not leave every
later process waiting (the tests kill engines and trainer ranks as they start, some while they load the kernels)."""

import subprocess
import sys
import threading

import pytest

from support_replay.kernels import build


def test_a_lock_file_left_by_a_killed_loader_is_removed_by_the_next_one(tmp_path):
    (tmp_path / "lock").touch()  # PyTorch's FileBaton, as a SIGKILLed process leaves it: fresh, and nobody's
    with build._one_builder(tmp_path):
        assert not (tmp_path / "lock").exists()


@pytest.mark.processes
def test_the_builder_lock_goes_with_a_killed_holder_and_waits_for_a_live_one(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from support_replay.kernels import build\n"
            f"with build._one_builder(Path({str(tmp_path)!r})):\n"
            "    (Path(sys.argv[1]) / 'lock').touch(); print('held', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def enter():
            with build._one_builder(tmp_path):
                entered.set()

        waiter = threading.Thread(target=enter, daemon=True)
        waiter.start()
        assert not entered.wait(1.0)  # a live holder (in PyTorch's builder) is waited for
        assert (tmp_path / "lock").exists()
        holder.kill()
        assert entered.wait(30)  # killed: the OS let its lock go, and its lock file went with the next one in
        assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
