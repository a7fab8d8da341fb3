"""The one save path and the one restore path that every face calls.

* :mod:`~ckptstore.pipeline.save`: stage -> plan -> write -> commit.
* :mod:`~ckptstore.pipeline.restore`: select -> read -> verify -> rebuild.

``ckptstore.save``/``load``, :class:`~ckptstore.manager.CheckpointManager`,
:mod:`ckptstore.manager.distributed`, the DCP writer/reader and the Lightning plug-in are thin
callers of these two modules: a capability (tiers, incremental saves, resharding) is added
here once, never per face. The pipeline sits above ``stage/`` (arrays to host buffers) and
``layout/`` (objects, manifest, commit), and knows nothing of when or why a face saves.
"""
