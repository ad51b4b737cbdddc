"""`quantize deploy --out` over a folder whose spec.json is not what an earlier deploy wrote: a device, a FIFO or a huge
sparse file is refused from its metadata (one line, exit 2, at once), never read whole or opened to block."""

from __future__ import annotations

import json
import os
import time

from test_deploy import deploy, promoted
from test_loadtest_runner import servers, tool  # noqa: F401 (fixtures)


def _devices(spec, tmp_path) -> None:
    spec.symlink_to("/dev/zero")


def _fifo(spec, tmp_path) -> None:
    os.mkfifo(spec)


def _sparse(spec, tmp_path) -> None:
    with spec.open("wb") as handle:
        handle.truncate(8 * 2**30)


def test_a_spec_json_that_is_no_regular_file_or_is_huge_is_refused_without_reading_it(tool, servers, workspace, tmp_path, capsys):
    promoted(workspace)
    capsys.readouterr()
    for make, message in ((_devices, "not a regular file"), (_fifo, "not a regular file"), (_sparse, "8589934592 bytes")):
        out = tmp_path / make.__name__
        out.mkdir()
        make(out / "spec.json", tmp_path)
        began = time.monotonic()
        assert deploy(workspace, out) == 2
        error = capsys.readouterr().err
        (line,) = [line for line in error.splitlines() if not line.startswith("> ")]
        assert line.startswith("quantize: error:") and message in line and "--out" in line, error
        assert time.monotonic() - began < 5 and (out / "spec.json").exists()


def test_a_folder_or_link_under_a_deploy_files_name_keeps_the_folder_someone_elses(tmp_path):
    from pipelines.deploy.files import SERVE_SCRIPT, SPEC_FILE, WRITTEN_BY, is_deploy_folder

    (tmp_path / SPEC_FILE).write_text(json.dumps({"written_by": WRITTEN_BY}))
    assert is_deploy_folder(tmp_path)
    (tmp_path / SERVE_SCRIPT).mkdir()
    (tmp_path / SERVE_SCRIPT / "notes.txt").write_text("mine")
    assert not is_deploy_folder(tmp_path)
    (tmp_path / SERVE_SCRIPT / "notes.txt").unlink()
    (tmp_path / SERVE_SCRIPT).rmdir()
    (tmp_path / SERVE_SCRIPT).symlink_to(tmp_path / SPEC_FILE)
    assert not is_deploy_folder(tmp_path)
