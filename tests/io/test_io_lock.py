"""The output lock: one writer per output, the holder named, stale locks taken over."""

import json
import os
import signal
import socket

import pytest

from entrenar.errors import ConfigError
from entrenar.io.lock import FOLDER_LOCK, OutputLock, lock_file, read_holder


def test_a_second_process_is_refused_naming_the_output_and_the_holder(
    tmp_path, hold_locks
):
    proc = hold_locks(f"{tmp_path}/", tmp_path / "model.gguf")
    try:
        holder = read_holder(str(tmp_path / FOLDER_LOCK))
        assert holder["pid"] == proc.pid and holder["host"] == socket.gethostname()
        for target, folder in ((tmp_path, True), (tmp_path / "model.gguf", False)):
            with pytest.raises(ConfigError) as e:
                OutputLock(target, folder=folder).acquire()
            assert str(target) in str(e.value)
            assert f"pid {proc.pid} on host {socket.gethostname()}" in str(e.value)
        with OutputLock(tmp_path / "other.gguf", folder=False):  # another file: free
            pass
    finally:
        proc.stdin.close()
        proc.wait()
    with OutputLock(tmp_path) as lock:  # released at the holder's exit
        assert lock.previous is None
    assert os.listdir(tmp_path) == []  # lock files are removed when released


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, hold_locks):
    proc = hold_locks(f"{tmp_path}/")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    path = tmp_path / FOLDER_LOCK
    assert json.loads(path.read_text())["pid"] == proc.pid  # left behind
    with OutputLock(tmp_path) as lock:
        assert lock.previous["pid"] == proc.pid
        assert read_holder(lock.path)["pid"] == os.getpid()
    assert not path.exists()


def test_the_lock_is_reentrant_in_a_process_and_leaves_no_trace(tmp_path):
    out = tmp_path / "new" / "run"
    outer = OutputLock(out).acquire()
    with OutputLock(out):  # train_from_yaml holds it, the Trainer takes it again
        pass
    assert (out / FOLDER_LOCK).exists()
    outer.release()
    assert not out.exists() and (tmp_path / "new").exists()  # created, left empty
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "new")
    assert lock_file(link) == lock_file(tmp_path / "new")  # one folder, one lock
    (tmp_path / "new" / FOLDER_LOCK).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="symbolic link"):
        OutputLock(tmp_path / "new").acquire()
    assert not (tmp_path / "elsewhere").exists()
