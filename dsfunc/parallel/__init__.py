"""Model parallelism over the mesh's axes: tensor parallelism (:mod:`dsfunc.parallel.tensor`), its plans
(:mod:`dsfunc.parallel.autotp`), the vocabulary split with its cross-entropy (:mod:`dsfunc.parallel.vocab`), and
where each parameter lives (:func:`placements`); Ulysses sequence parallelism (:mod:`dsfunc.parallel.ulysses`,
:mod:`dsfunc.parallel.sequence`, :mod:`dsfunc.parallel.hf_attention`)."""

from dsfunc.parallel.placements import placements

__all__ = ["placements"]
