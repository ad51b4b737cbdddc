"""The one reader of run-folder files: a link, FIFO, device or folder is refused without being opened; size is bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.errors import InputError
from pipelines.files.run_input import read_regular, read_regular_from, read_regular_tail


def _fifo(folder: Path) -> Path:
    os.mkfifo(folder / "state.json")  # opening it would block: the reader must refuse before that
    return folder / "state.json"


def _link_to_dev_zero(folder: Path) -> Path:
    (folder / "state.json").symlink_to("/dev/zero")
    return folder / "state.json"


def _folder(folder: Path) -> Path:
    (folder / "state.json").mkdir()
    return folder / "state.json"


@pytest.mark.parametrize("make", [_fifo, _link_to_dev_zero, _folder])
def test_anything_but_a_regular_file_is_refused_naming_it(make, tmp_path: Path) -> None:
    path = make(tmp_path)
    for read in (lambda: read_regular(path, "deployment state", 1024, field="--out"), lambda: read_regular_tail(path, "log", 1024),
                 lambda: read_regular_from(path, "log", 0, 1024)):
        with pytest.raises(InputError, match="not a regular file") as caught:
            read()
        assert caught.value.file == str(path)


def test_a_sparse_file_over_the_bound_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    with path.open("wb") as handle:
        handle.truncate(8 * 1024**3)
    with pytest.raises(InputError, match="8589934592 bytes"):
        read_regular(path, "spec.json", 1024)
    assert read_regular_tail(path, "log", 16) == b"\0" * 16


def test_a_regular_file_reads_whole_and_from_an_offset(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"first line\nlast line\n")
    assert read_regular(path, "log", 100) == b"first line\nlast line\n"
    assert read_regular_from(path, "log", 11, 100) == (11, b"last line\n")
    assert read_regular_from(path, "log", 500, 100)[0] == 0  # truncated since: read again from the start
