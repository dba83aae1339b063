"""The ``kvmesh`` command line: ``up``, ``replay``, ``compare`` (console script ``kvmesh_cli.entry:main``, which runs ``kvmesh_cli.main:app``)."""
