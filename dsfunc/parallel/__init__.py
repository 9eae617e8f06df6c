"""Parallelism along the mesh's axes other than ZeRO's: Ulysses sequence parallelism (:mod:`dsfunc.parallel.ulysses`,
:mod:`dsfunc.parallel.sequence`, :mod:`dsfunc.parallel.hf_attention`)."""
