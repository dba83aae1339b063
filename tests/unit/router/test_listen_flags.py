"""kvmesh.listen: a listener's error names its process's port flag; a launcher renames it to its own."""

from __future__ import annotations

from kvmesh.listen import ListenError, rename_port_flags


def test_hint_names_the_process_flag_and_the_launcher_renames_it() -> None:
    exc = ListenError("http", "127.0.0.1", 8000, "Address already in use")
    line = f"router: {exc} ({exc.hint()})"
    assert exc.flag == "--http-port" and line.endswith("choose another port with --http-port)")
    flags = {"--http-port": "--router-port", "--grpc-port": "--router-grpc-port"}
    renamed = rename_port_flags(f"log line\n{line}\n", flags)
    assert renamed.endswith("choose another port with --router-port)\n") and "--http-port" not in renamed
    grpc = ListenError("grpc", "127.0.0.1", 1, "Address already in use")
    assert rename_port_flags(grpc.hint(), flags).endswith("--router-grpc-port")
    metrics = ListenError("metrics", "127.0.0.1", 1, "Address already in use")
    assert rename_port_flags(metrics.hint(), flags) == metrics.hint()  # no entry: unchanged
