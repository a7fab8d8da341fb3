"""The one save path and the one restore path that every face calls.

* :mod:`~ckptstore.pipeline.save`: stage -> plan -> write -> commit.
* :mod:`~ckptstore.pipeline.restore`: select -> read -> verify -> rebuild.

``ckptstore.save``/``load``, :class:`~ckptstore.manager.CheckpointManager`,
:mod:`ckptstore.manager.distributed`, the DCP writer/reader and the Lightning plug-in are thin
callers of these two modules: a capability (tiers, incremental saves, resharding) is added
here once, never per face. The pipeline sits above ``stage/`` (arrays to host buffers) and
``layout/`` (objects, manifest, commit), and knows nothing of when or why a face saves.

It is also the engine's whole interface: faces and the multi-rank runtime import nothing from
``layout/`` or ``stage/``, only from these modules (docs/design.md, "The engine's interface",
lists every name; ``tests/test_layers.py`` holds both to it):

* :mod:`~ckptstore.pipeline.root`: a root as a URL, a path or an open Store.
* :mod:`~ckptstore.pipeline.steps`: list, read, delete, set aside, recover, collect steps.
* :mod:`~ckptstore.pipeline.maintenance`: summarize, verify and copy whole steps.
* :mod:`~ckptstore.pipeline.codec` and :mod:`~ckptstore.pipeline.tensors`: walk and name a
  face's own tree, and the dtype registry (torch's side imports torch).
* :mod:`~ckptstore.pipeline.sharding`: sharded leaves of a multi-rank save.
* :mod:`~ckptstore.pipeline.streaming` and :mod:`~ckptstore.pipeline.deadline`: the streaming
  restore's fence, and a deadline on a face's own awaited work.
"""
