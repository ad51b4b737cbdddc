"""serve export's --out: an earlier export is known by the marker it wrote, never by a file name users also use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.errors import InputError
from pipelines.fleet.export_folder import MARKER, check_out, marker_document


def _export(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / MARKER).write_text(marker_document(files))


def test_new_empty_and_untouched_earlier_exports_are_accepted(tmp_path: Path) -> None:
    check_out(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty")
    _export(tmp_path / "ours", {"kustomization.yaml": "a\n", "x-secret.yaml": "b\n"})
    check_out(tmp_path / "ours")


def test_a_users_kustomize_folder_is_not_an_earlier_export(tmp_path: Path) -> None:
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "kustomization.yaml").write_text("resources: [app.yaml]\n")
    with pytest.raises(InputError, match=f"no {MARKER}"):
        check_out(tmp_path / "users")


@pytest.mark.parametrize("marker", ['{"files": {}}', '{"written_by": "someone", "files": {}}', "[]", "not json",
                                    '{"written_by": "quantize serve export", "files": [1]}'])
def test_a_marker_the_export_did_not_write_is_refused(tmp_path: Path, marker: str) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / MARKER).write_text(marker)
    with pytest.raises(InputError):
        check_out(tmp_path / "out")


def test_a_marker_that_is_a_fifo_or_a_link_is_refused_unopened(tmp_path: Path) -> None:
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / MARKER)
    with pytest.raises(InputError, match="not a regular file"):
        check_out(tmp_path / "fifo")
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / MARKER).symlink_to("/dev/zero")
    with pytest.raises(InputError, match="not a regular file"):
        check_out(tmp_path / "link")


def test_an_added_edited_or_swapped_file_keeps_the_folder(tmp_path: Path) -> None:
    _export(tmp_path / "out", {"kustomization.yaml": "a\n"})
    (tmp_path / "out" / "overlays").mkdir()
    with pytest.raises(InputError, match="'overlays', not written by the export"):
        check_out(tmp_path / "out")
    (tmp_path / "out" / "overlays").rmdir()
    (tmp_path / "out" / "kustomization.yaml").unlink()
    (tmp_path / "out" / "kustomization.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    with pytest.raises(InputError, match="not a regular file"):
        check_out(tmp_path / "out")
    (tmp_path / "out" / "kustomization.yaml").unlink()
    (tmp_path / "out" / "kustomization.yaml").write_text("edited\n")
    with pytest.raises(InputError, match="changed since"):
        check_out(tmp_path / "out")


def test_a_link_as_the_out_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real")
    with pytest.raises(InputError, match="link"):
        check_out(tmp_path / "out")
