"""Resuming from DeepSpeed's own checkpoints, at any world size and ZeRO stage.

:func:`dsfunc.load_checkpoint` (and the engine's ``load_checkpoint``) recognise a DeepSpeed checkpoint
folder and come here. One module per concept:

* :mod:`.folder`: which files a DeepSpeed tag folder holds, and the layouts refused (pipeline parallel,
  NVMe offload);
* :mod:`.unpickle`: reading DeepSpeed's pickles without DeepSpeed and without running their code;
* :mod:`.shards`: where each parameter lies in the shard files, and reading pieces of it one shard at a time;
* :mod:`.autotp` and :mod:`.experts`: the tp ranks' parts (AutoTP) and the MoE experts' files and shards, named
  as in the whole model;
* :mod:`.contents`: what the checkpoint says besides tensors (precision, counters, scheduler, loss scaler,
  client state);
* :mod:`.mapping`: how it fills a dsfunc template state, one unit at a time;
* :mod:`.load`: the load itself;
* :mod:`.weights`: its weights by name, streamed, for ``dsfunc export``.

The package imports nothing itself: :mod:`dsfunc.checkpoint.tags` uses :mod:`.folder`, which must not pull
in the loader (that imports the tags).
"""
