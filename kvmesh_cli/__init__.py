"""The ``kvmesh`` command line: ``up``, ``replay``, ``compare`` (entry point ``kvmesh_cli.main:app``)."""
