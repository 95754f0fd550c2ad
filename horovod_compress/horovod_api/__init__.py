"""Horovod's API on mpi4py, shared by the three Horovod-shaped front-ends (PyTorch, TensorFlow, Keras).

:mod:`.basics` (init, ranks, process sets, the reductions' scaling, the
timeline), :mod:`.common` (the names every front-end re-exports) and
:mod:`.elastic` (Horovod's elastic ``State``/``run`` on a fixed MPI world).
Framework-free, as Horovod's own ``horovod/common``: a front-end registers its
process-group state here (:func:`.basics.register_world`) instead of this
layer importing the front-end.
"""
