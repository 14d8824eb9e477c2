"""`zcore.checkpoint.atomic_write` / `atomic_path`: old file or complete new one, never less."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import BinaryIO

import pytest

from zcore.checkpoint import atomic_path, atomic_write


def test_writes_with_the_mode_of_an_ordinary_new_file(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "sub" / "a.bin", lambda f: f.write(b"hello"))
    finally:
        os.umask(old)
    target = tmp_path / "sub" / "a.bin"
    assert target.read_bytes() == b"hello"
    assert target.stat().st_mode & 0o777 == 0o640  # not mkstemp's 0600
    assert os.listdir(target.parent) == ["a.bin"]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "a.txt"
    target.write_text("old")

    def half_then_fail(f: BinaryIO) -> None:
        f.write(b"partial new content")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.txt"]

    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_text("new")
        raise KeyboardInterrupt
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.txt"]


def test_concurrent_writers_each_publish_a_complete_file(tmp_path: Path) -> None:
    target = tmp_path / "shared.bin"
    payloads = [bytes([i]) * 1_000_000 for i in range(8)]
    threads = [
        threading.Thread(target=atomic_write, args=(target, lambda f, p=p: f.write(p)))
        for p in payloads
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_bytes() in payloads
    assert os.listdir(tmp_path) == ["shared.bin"]
